"""The lag monitor behind `pipeline status`.

`collect_status` reads, for one consumer group, the committed offset and the end
offset of every partition of its topics, the group's state and members, the
dead-letter topic's size and (with an output directory) what the worker wrote,
and returns one JSON-able dict; `render_table` is its human form and `watch`
refreshes it every few seconds.

Verdicts, in the spirit of Burrow, judged per partition over a short history of
samples (`StatusHistory`) and for the group as the worst of its partitions:

    verdict   exit code  meaning
    OK        0          no lag, or the lag is shrinking (the group catches up)
    LAGGING   1          lag > 0 and not shrinking: commits move no faster than
                         the end (also the verdict for lag > 0 with one sample)
    STALLED   2          lag > 0, members present, but the committed offset did
                         not move across the whole history window (at least
                         `stall_after_seconds` long)
    STOPPED   3          lag > 0 and nobody consumes it: the group has no members
                         (Empty/Dead), or it is Stable and no member owns the
                         partition

`exit_code_for(verdict)` gives the exit code, so that scripts and health checks
can act on `pipeline status` without parsing it.

Every Kafka call is bounded (bootstrap, requests and the record fetch behind
`lag_seconds` each have a timeout) and every client is closed before returning.
Expected failures raise `PipelineError`s with one actionable message.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

import kafka.errors as kerrors
import pyarrow as pa
import pyarrow.parquet as pq
from kafka import KafkaConsumer, TopicPartition
from kafka.admin import KafkaAdminClient
from kafka.net.compat import KafkaNetClient
from kafka.protocol.consumer import OffsetSpec
from kafka.protocol.consumer.metadata import ConsumerProtocolAssignment

from pipeline.config import KafkaSettings
from pipeline.errors import BrokerUnavailable, PipelineError, TopicMissing
from sinks.layout import INDEX_META_FILE, index_dir, iter_segments

OK = "OK"
LAGGING = "LAGGING"
STALLED = "STALLED"
STOPPED = "STOPPED"
VERDICTS = (OK, LAGGING, STALLED, STOPPED)  # in order of severity
_EXIT_CODES = {OK: 0, LAGGING: 1, STALLED: 2, STOPPED: 3}
# Group states in which nobody consumes, whatever the lag (KIP-518 names).
_IDLE_STATES = frozenset({"Empty", "Dead"})

# A status probe should answer in seconds, not wait out the 30 s client defaults.
BOOTSTRAP_TIMEOUT_MS = 5_000
REQUEST_TIMEOUT_MS = 10_000
DEFAULT_TIMEOUT_S = 15.0
TIMESTAMP_FETCH_S = 5.0
_RETRY_BACKOFF_S = 0.2

Key = tuple[str, int]
T = TypeVar("T")


# --------------------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class Point:
    """One partition as seen at one refresh."""

    time: float
    committed: int | None
    end: int

    @property
    def lag(self) -> int:
        return partition_lag(self.committed, self.end)


def partition_lag(committed: int | None, end: int) -> int:
    """End minus committed; the whole partition when nothing is committed."""
    if committed is None:
        return end
    # A committed offset past the end (topic recreated, records truncated) is
    # not negative work; clamp so that total_lag stays meaningful.
    return max(0, end - committed)


def judge_partition(
    points: Sequence[Point], *, consumed: bool, stall_after_seconds: float = 30.0
) -> str:
    """The verdict for one partition from its samples, oldest first.

    `consumed` says whether anybody could be consuming it (the group has members
    and, when the assignment is known, one of them owns the partition).
    """
    if not points:
        raise ValueError("judge_partition needs at least one sample")
    last = points[-1]
    if last.lag == 0:
        return OK
    if not consumed:
        return STOPPED
    first = _first_committed(points)
    if first is None or first is last:
        # One sample (or nothing committed yet): we only know there is lag.
        return LAGGING
    if first.committed == last.committed:
        # Commits did not move. Only call it a stall once the window is long
        # enough: a worker busy on one large batch commits seconds apart.
        span = last.time - first.time
        return STALLED if span >= stall_after_seconds else LAGGING
    if last.lag < first.lag:
        return OK  # commits outrun the end: the group is catching up
    return LAGGING


def worst(verdicts: Iterable[str]) -> str:
    """The most severe verdict; OK for none."""
    return max(verdicts, key=VERDICTS.index, default=OK)


def exit_code_for(verdict: str) -> int:
    """OK 0, LAGGING 1, STALLED 2, STOPPED 3."""
    try:
        return _EXIT_CODES[verdict]
    except KeyError:
        raise ValueError(f"unknown verdict {verdict!r}; expected one of {VERDICTS}") from None


def commit_rate(points: Sequence[Point]) -> float | None:
    """Records per second committed over the samples; None without two timed commits."""
    first = _first_committed(points)
    last = points[-1] if points else None
    if first is None or last is None or last.committed is None:
        return None
    span = last.time - first.time
    if span <= 0:
        return None
    return max(0.0, (last.committed - first.committed) / span)


def end_rate(points: Sequence[Point]) -> float | None:
    """Records per second appended to the partition over the samples."""
    if len(points) < 2 or points[-1].time <= points[0].time:
        return None
    return max(0.0, (points[-1].end - points[0].end) / (points[-1].time - points[0].time))


def drain_eta(lag: int, consumed_per_s: float | None, produced_per_s: float | None) -> float | None:
    """Seconds until the lag is gone at the current rates; None when it never drains."""
    if lag == 0:
        return 0.0
    if consumed_per_s is None:
        return None
    # Net rate: what the group commits minus what producers keep appending.
    net = consumed_per_s - (produced_per_s or 0.0)
    return lag / net if net > 0 else None


def _first_committed(points: Sequence[Point]) -> Point | None:
    # A partition may gain its first commit inside the window; rates and stall
    # detection start from the first sample that has one.
    return next((p for p in points if p.committed is not None), None)


# --------------------------------------------------------------------------- history


class StatusHistory:
    """Recent samples of (committed, end) per partition, kept between refreshes.

    In memory for `--watch`; `save`/`load` persist it to a small JSON file so
    that separate `pipeline status` runs (cron, health checks) can judge trends.
    """

    def __init__(
        self,
        window_seconds: float = 600.0,
        max_samples: int = 30,
        stall_after_seconds: float = 30.0,
        group: str | None = None,
    ) -> None:
        self.window_seconds = window_seconds
        self.max_samples = max(2, max_samples)
        self.stall_after_seconds = stall_after_seconds
        self.group = group
        self.samples: list[tuple[float, dict[Key, tuple[int | None, int]]]] = []

    def add(self, when: float, offsets: Mapping[Key, tuple[int | None, int]]) -> None:
        """Appends a sample and forgets those that left the window."""
        self.samples.append((when, dict(offsets)))
        self.samples.sort(key=lambda sample: sample[0])
        horizon = self.samples[-1][0] - self.window_seconds
        # Keep at least two samples whatever their age: a trend needs two.
        while len(self.samples) > 2 and (
            len(self.samples) > self.max_samples or self.samples[0][0] < horizon
        ):
            self.samples.pop(0)

    def points(self, topic: str, partition: int) -> list[Point]:
        key = (topic, partition)
        return [Point(when, *offsets[key]) for when, offsets in self.samples if key in offsets]

    def span_seconds(self) -> float:
        return self.samples[-1][0] - self.samples[0][0] if self.samples else 0.0

    def clear(self) -> None:
        self.samples.clear()

    def to_dict(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "window_seconds": self.window_seconds,
            "max_samples": self.max_samples,
            "stall_after_seconds": self.stall_after_seconds,
            "samples": [
                {
                    "time": when,
                    "offsets": {f"{t}:{p}": list(value) for (t, p), value in offsets.items()},
                }
                for when, offsets in self.samples
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StatusHistory:
        history = cls(
            window_seconds=float(data.get("window_seconds", 600.0)),
            max_samples=int(data.get("max_samples", 30)),
            stall_after_seconds=float(data.get("stall_after_seconds", 30.0)),
            group=data.get("group"),
        )
        for sample in data.get("samples", []):
            offsets = {}
            for name, (committed, end) in sample["offsets"].items():
                topic, _, partition = name.rpartition(":")
                offsets[(topic, int(partition))] = (committed, int(end))
            history.add(float(sample["time"]), offsets)
        return history

    def save(self, path: Path) -> None:
        # Write aside and rename so that a reader never sees half a file.
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict()), encoding="utf-8")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, **defaults: Any) -> StatusHistory:
        """Reads a saved history; a missing or unreadable file gives an empty one."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls.from_dict(data)
        except (OSError, ValueError, KeyError, TypeError):
            return cls(**defaults)


# --------------------------------------------------------------------------- Kafka reads


def _client_kwargs(kafka: KafkaSettings) -> dict[str, Any]:
    kwargs = kafka.client_kwargs()
    kwargs["request_timeout_ms"] = min(kafka.request_timeout_ms, REQUEST_TIMEOUT_MS)
    kwargs["bootstrap_timeout_ms"] = BOOTSTRAP_TIMEOUT_MS
    return kwargs


def _unreachable(kafka: KafkaSettings) -> BrokerUnavailable:
    return BrokerUnavailable(
        f"no Kafka broker answered at {kafka.bootstrap_servers}; "
        "start one (scripts/dev-kafka.sh start) or set --bootstrap-servers"
    )


@contextlib.contextmanager
def _kafka_errors(kafka: KafkaSettings, group: str) -> Iterator[None]:
    """Turns kafka-python errors into one-line PipelineErrors."""
    try:
        yield
    except PipelineError:
        raise
    except kerrors.AuthorizationError as exc:
        raise PipelineError(
            f"not authorised to read the status of group {group!r}: {exc}; "
            "check the credentials and ACLs"
        ) from exc
    except (
        kerrors.KafkaTimeoutError,
        kerrors.KafkaConnectionError,
        kerrors.NodeNotReadyError,
    ) as exc:
        raise _unreachable(kafka) from exc
    except kerrors.KafkaError as exc:
        raise PipelineError(
            f"Kafka refused a status request for group {group!r} "
            f"at {kafka.bootstrap_servers}: {exc}"
        ) from exc


def _retrying(call: Callable[[], T], deadline: float) -> T:
    """Retries retriable errors (the coordinator still loading, leader moves) until deadline."""
    while True:
        try:
            return call()
        except kerrors.KafkaError as exc:
            if not exc.retriable or time.monotonic() + _RETRY_BACKOFF_S >= deadline:
                raise
            time.sleep(_RETRY_BACKOFF_S)


def _build_client(make: Callable[..., T], **configs: Any) -> T:
    """Builds a kafka-python client; stops its IO thread again if the constructor fails.

    kafka-python 3 starts a network thread before bootstrapping and leaves it
    running when bootstrap times out; under `--watch` against a broker that is
    down, that would leak a thread and its sockets on every refresh.
    """
    created: list[KafkaNetClient] = []

    def net_client(**kwargs: Any) -> KafkaNetClient:
        created.append(KafkaNetClient(**kwargs))
        return created[-1]

    try:
        return make(**configs, kafka_client=net_client)
    except BaseException:
        for client in created:
            client.close()
            client._net.stop(timeout_ms=1_000)
        raise


def _open_admin(kafka: KafkaSettings) -> KafkaAdminClient:
    try:
        return _build_client(KafkaAdminClient, **_client_kwargs(kafka))
    except (
        kerrors.KafkaTimeoutError,
        kerrors.KafkaConnectionError,
    ) as exc:
        raise _unreachable(kafka) from exc


def _committed_offsets(admin: KafkaAdminClient, group: str, deadline: float) -> dict[Key, int]:
    by_group = _retrying(lambda: admin.list_group_offsets({group: None}), deadline)
    committed = {}
    for tp, meta in by_group.get(group, {}).items():
        if meta.offset is not None and meta.offset >= 0:  # -1: nothing committed
            committed[(tp.topic, tp.partition)] = meta.offset
    return committed


def _partitions_of(
    admin: KafkaAdminClient, topics: Sequence[str], deadline: float
) -> dict[str, list[int] | None]:
    """Partition numbers per topic; None for a topic that does not exist."""
    described = _retrying(lambda: admin.describe_topics(list(topics)), deadline)
    found: dict[str, list[int] | None] = dict.fromkeys(topics)
    for topic in described:
        if topic["error_code"] == 0 and topic["name"] in found:
            found[topic["name"]] = sorted(p["partition_index"] for p in topic["partitions"])
    return found


def _list_offsets(
    admin: KafkaAdminClient, keys: Sequence[Key], spec: OffsetSpec, deadline: float
) -> dict[Key, int]:
    if not keys:
        return {}
    timeout_ms = max(1, int((deadline - time.monotonic()) * 1000))
    specs = {TopicPartition(t, p): spec for t, p in keys}
    result = _retrying(lambda: admin.list_partition_offsets(specs, timeout_ms=timeout_ms), deadline)
    return {(tp.topic, tp.partition): value.offset for tp, value in result.items()}


def _describe_group(admin: KafkaAdminClient, group: str, deadline: float) -> dict[str, Any]:
    described = _retrying(lambda: admin.describe_groups([group]), deadline)
    info = described.get(group, {})
    members = [_member(raw) for raw in info.get("members") or []]
    state = info.get("group_state") or "Unknown"
    error = info.get("error")
    # GroupIdNotFound just means no live group: it reads as Dead, no warning.
    warning = None if not error or "GroupIdNotFound" in error else error
    return {"state": state, "members": members, "warning": warning}


def _member(raw: Mapping[str, Any]) -> dict[str, Any]:
    host = str(raw.get("client_host") or "")
    return {
        "member_id": raw.get("member_id"),
        "client_id": raw.get("client_id"),
        "host": host.lstrip("/"),  # the broker reports "/127.0.0.1"
        "assignments": [
            {"topic": t, "partition": p} for t, p in _assigned(raw.get("member_assignment"))
        ],
    }


def _assigned(raw: Any) -> list[Key]:
    """(topic, partition) pairs of a member assignment, decoded or raw bytes."""
    if isinstance(raw, bytes | bytearray):
        if not raw:
            return []
        try:
            raw = ConsumerProtocolAssignment.decode(bytes(raw))
        except Exception:  # a non-consumer protocol: we cannot tell the owners
            return []
    if hasattr(raw, "to_dict"):
        raw = raw.to_dict()
    if not isinstance(raw, Mapping):
        return []
    pairs = []
    for entry in raw.get("assigned_partitions") or []:
        if isinstance(entry, Mapping):
            topic, partitions = entry.get("topic"), entry.get("partitions") or []
        else:
            topic, partitions = entry
        pairs.extend((topic, int(p)) for p in partitions)
    return sorted(pairs)


def _oldest_timestamps(
    kafka: KafkaSettings, positions: Mapping[Key, int], budget_s: float
) -> dict[Key, int]:
    """Timestamp (ms) of the first record at or after each position.

    A short-lived consumer without a group (assign + seek, nothing committed)
    fetches one record per partition; partitions that give nothing within the
    budget are left out (their lag_seconds stays null).
    """
    if not positions:
        return {}
    consumer = _build_client(
        KafkaConsumer,
        **_client_kwargs(kafka),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",  # a position deleted by retention: next oldest
        fetch_max_wait_ms=100,
        max_partition_fetch_bytes=64 * 1024,  # one record is all we need
        metrics_enabled=False,
    )
    found: dict[Key, int] = {}
    try:
        tps = {TopicPartition(t, p): off for (t, p), off in positions.items()}
        consumer.assign(list(tps))
        for tp, offset in tps.items():
            consumer.seek(tp, offset)
        deadline = time.monotonic() + budget_s
        while len(found) < len(tps) and (left := deadline - time.monotonic()) > 0:
            batch = consumer.poll(timeout_ms=int(min(left, 1.0) * 1000) + 1)
            for tp, records in batch.items():
                key = (tp.topic, tp.partition)
                if records and key not in found:
                    found[key] = records[0].timestamp
                    consumer.pause(tp)  # stop fetching what we already have
    finally:
        consumer.close(autocommit=False, timeout_ms=2_000)
    return {key: ts for key, ts in found.items() if ts is not None and ts >= 0}


# --------------------------------------------------------------------------- output dir


def _output_facts(output: Path) -> tuple[dict[Key, dict[str, Any]], list[str]]:
    """Rows, files and coverage per partition from Parquet footers, plus index entries."""
    facts: dict[Key, dict[str, Any]] = {}
    warnings: list[str] = []
    for name, path in iter_segments(output):
        entry = facts.setdefault(
            (name.topic, name.partition), {"rows": 0, "files": 0, "covered_through": None}
        )
        entry["files"] += 1
        entry["covered_through"] = max(entry["covered_through"] or -1, name.last)
        try:
            entry["rows"] += pq.read_metadata(path).num_rows  # footer only: cheap
        except (OSError, pa.ArrowException) as exc:
            warnings.append(f"cannot read {path}: {exc}")
    entries, problem = _index_entries(output)
    if problem:
        warnings.append(problem)
    for key, count in entries.items():
        facts.setdefault(key, {"rows": 0, "files": 0, "covered_through": None})
        facts[key]["index_entries"] = count
    return facts, warnings


def _index_entries(output: Path) -> tuple[dict[Key, int], str | None]:
    path = index_dir(output) / INDEX_META_FILE
    if not path.is_file():
        return {}, None
    try:
        raw = json.loads(path.read_text(encoding="utf-8")).get("entries") or {}
        entries = {}
        for name, count in raw.items():
            topic, _, partition = name.rpartition(":")
            entries[(topic, int(partition))] = int(count)
        return entries, None
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        return {}, f"cannot read {path}: {exc}"


def _mismatch(committed: int | None, facts: Mapping[str, Any]) -> str | None:
    problems = []
    covered = facts.get("covered_through")
    written_to = -1 if covered is None else covered
    if committed is not None and committed > written_to + 1:
        # Committed past what the files hold: those records would never be embedded.
        where = "no files" if covered is None else f"files cover through {covered}"
        problems.append(f"committed {committed} past written data ({where})")
    entries = facts.get("index_entries")
    if entries is not None and entries != facts.get("rows", 0):
        problems.append(f"index has {entries} entries for {facts.get('rows', 0)} rows")
    return "; ".join(problems) or None


# --------------------------------------------------------------------------- collect


def collect_status(
    kafka: KafkaSettings,
    group: str,
    topics: Sequence[str] | None = None,
    output: Path | None = None,
    history: StatusHistory | None = None,
    *,
    dlq_topic: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    now: Callable[[], float] = time.time,
) -> dict[str, Any]:
    """One status report of `group` as a JSON-able dict (see the module docstring).

    With `topics` None, the topics the group has committed offsets for. The
    sample is added to `history` (if given) and verdicts use its trend.
    """
    if not group.strip():
        raise PipelineError("give the consumer group to report on (--group)")
    deadline = time.monotonic() + timeout_s
    warnings: list[str] = []
    with _kafka_errors(kafka, group):
        admin = _open_admin(kafka)
        try:
            committed = _committed_offsets(admin, group, deadline)
            names = _resolve_topics(group, topics, committed)
            partitions = _partitions_of(admin, names, deadline)
            names = _drop_missing(partitions, named=topics is not None, warnings=warnings)
            keys = [(t, p) for t in names for p in partitions[t] or []]
            ends = _list_offsets(admin, keys, OffsetSpec.LATEST, deadline)
            beginnings = _list_offsets(admin, keys, OffsetSpec.EARLIEST, deadline)
            group_info = _describe_group(admin, group, deadline)
            dead_letter = _dead_letter(admin, dlq_topic or f"{names[0]}.dlq", deadline)
        finally:
            admin.close()
        sampled_at = now()
        positions = _lagging_positions(keys, committed, ends, beginnings)
        timestamps = _timestamps_or_warn(kafka, positions, deadline, warnings)
    if group_info["warning"]:
        warnings.append(f"describe group: {group_info['warning']}")

    history = _history_for(group, history)
    history.add(sampled_at, {k: (committed.get(k), ends[k]) for k in keys})
    facts = None
    if output is not None:
        facts, output_warnings = _output_facts(output)
        warnings.extend(output_warnings)

    owners = _owners(group_info["members"])
    rows = [
        _partition_row(
            key,
            committed.get(key),
            ends[key],
            beginnings.get(key, 0),
            timestamps.get(key),
            sampled_at,
            history,
            group_info,
            owners,
            facts,
        )
        for key in keys
    ]
    return _group_summary(
        group, names, rows, group_info, dead_letter, history, sampled_at, output, warnings
    )


def _resolve_topics(
    group: str, topics: Sequence[str] | None, committed: Mapping[Key, int]
) -> list[str]:
    if topics is not None:
        names = list(dict.fromkeys(t for t in topics if t))  # dedupe, keep order
        if not names:
            raise PipelineError("give at least one --topic")
        return names
    names = sorted({topic for topic, _ in committed})
    if not names:
        raise PipelineError(
            f"consumer group {group!r} has no committed offsets (it does not exist or "
            "never committed); check --group, or name the topics with --topic"
        )
    return names


def _drop_missing(
    partitions: Mapping[str, list[int] | None], *, named: bool, warnings: list[str]
) -> list[str]:
    missing = [t for t, parts in partitions.items() if parts is None]
    if missing and named:
        raise TopicMissing(
            f"topic {', '.join(missing)} does not exist; "
            "create it (pipeline topics create) or check --topic"
        )
    for topic in missing:
        # Offsets committed for a topic deleted since: report, but do not fail.
        warnings.append(f"group has offsets for {topic}, which no longer exists")
    present = [t for t, parts in partitions.items() if parts is not None]
    if not present:
        raise TopicMissing(f"none of the group's topics exist any more: {', '.join(missing)}")
    return present


def _dead_letter(admin: KafkaAdminClient, topic: str, deadline: float) -> dict[str, Any]:
    partitions = _partitions_of(admin, [topic], deadline)[topic]
    if partitions is None:
        return {"topic": topic, "records": None}
    keys = [(topic, p) for p in partitions]
    ends = _list_offsets(admin, keys, OffsetSpec.LATEST, deadline)
    beginnings = _list_offsets(admin, keys, OffsetSpec.EARLIEST, deadline)
    return {"topic": topic, "records": sum(ends[k] - beginnings[k] for k in keys)}


def _lagging_positions(
    keys: Sequence[Key],
    committed: Mapping[Key, int],
    ends: Mapping[Key, int],
    beginnings: Mapping[Key, int],
) -> dict[Key, int]:
    """Where the oldest unconsumed record of each lagging partition sits."""
    positions = {}
    for key in keys:
        start = beginnings.get(key, 0)
        position = max(committed.get(key, start), start)  # retention may have passed it
        if partition_lag(committed.get(key), ends[key]) > 0 and position < ends[key]:
            positions[key] = position
    return positions


def _timestamps_or_warn(
    kafka: KafkaSettings, positions: Mapping[Key, int], deadline: float, warnings: list[str]
) -> dict[Key, int]:
    budget = min(TIMESTAMP_FETCH_S, max(1.0, deadline - time.monotonic()))
    try:
        return _oldest_timestamps(kafka, positions, budget)
    except kerrors.KafkaError as exc:
        # Offsets are the core of the report; the time lag is a bonus.
        warnings.append(f"could not read record timestamps: {exc}")
        return {}


def _history_for(group: str, history: StatusHistory | None) -> StatusHistory:
    if history is None:
        return StatusHistory(group=group)
    if history.group not in (None, group):
        history.clear()  # samples of another group say nothing about this one
    history.group = group
    return history


def _owners(members: Sequence[Mapping[str, Any]]) -> dict[Key, dict[str, Any]]:
    owners = {}
    for member in members:
        owner = {k: member[k] for k in ("member_id", "client_id", "host")}
        for assignment in member["assignments"]:
            owners[(assignment["topic"], assignment["partition"])] = owner
    return owners


def _is_consumed(key: Key, group_info: Mapping[str, Any], owners: Mapping[Key, Any]) -> bool:
    if not group_info["members"] or group_info["state"] in _IDLE_STATES:
        return False
    if group_info["state"] == "Stable" and owners:
        # A settled assignment that leaves this partition out: nobody reads it.
        return key in owners
    return True  # rebalancing, or assignments we cannot decode: assume it is read


def _partition_row(
    key: Key,
    committed: int | None,
    end: int,
    beginning: int,
    timestamp_ms: int | None,
    sampled_at: float,
    history: StatusHistory,
    group_info: Mapping[str, Any],
    owners: Mapping[Key, dict[str, Any]],
    facts: Mapping[Key, Mapping[str, Any]] | None,
) -> dict[str, Any]:
    lag = partition_lag(committed, end)
    points = history.points(*key)
    rate = commit_rate(points)
    row: dict[str, Any] = {
        "topic": key[0],
        "partition": key[1],
        "beginning": beginning,
        "committed": committed,
        "end": end,
        "lag": lag,
        "lag_seconds": _lag_seconds(lag, timestamp_ms, sampled_at),
        "owner": owners.get(key),
        "throughput": rate,
        "eta_seconds": drain_eta(lag, rate, end_rate(points)),
        "verdict": judge_partition(
            points,
            consumed=_is_consumed(key, group_info, owners),
            stall_after_seconds=history.stall_after_seconds,
        ),
    }
    if facts is not None:
        found = facts.get(key, {})
        row["rows"] = found.get("rows", 0)
        row["files"] = found.get("files", 0)
        row["covered_through"] = found.get("covered_through")
        row["index_entries"] = found.get("index_entries")
        row["mismatch"] = _mismatch(committed, found)
    return row


def _lag_seconds(lag: int, timestamp_ms: int | None, sampled_at: float) -> float | None:
    if lag == 0 or timestamp_ms is None:
        return None  # nothing unconsumed, or its record could not be read in time
    # Producer clocks may run ahead of ours; a future timestamp is no lag.
    return round(max(0.0, sampled_at - timestamp_ms / 1000), 3)


def _group_summary(
    group: str,
    topics: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    group_info: Mapping[str, Any],
    dead_letter: Mapping[str, Any],
    history: StatusHistory,
    sampled_at: float,
    output: Path | None,
    warnings: Sequence[str],
) -> dict[str, Any]:
    total_lag = sum(r["lag"] for r in rows)
    throughput = _sum_known(r["throughput"] for r in rows)
    produced = _sum_known(end_rate(history.points(r["topic"], r["partition"])) for r in rows)
    lag_seconds = [r["lag_seconds"] for r in rows if r["lag_seconds"] is not None]
    # Nothing unconsumed anywhere: the group is zero seconds behind, not unknown.
    max_lag_seconds = 0.0 if total_lag == 0 else max(lag_seconds, default=None)
    verdict = worst(r["verdict"] for r in rows)
    return {
        "group": group,
        "state": group_info["state"],
        "topics": list(topics),
        "members": list(group_info["members"]),
        "total_lag": total_lag,
        "max_lag_seconds": max_lag_seconds,
        "throughput": throughput,
        "eta_seconds": drain_eta(total_lag, throughput, produced),
        "verdict": verdict,
        "exit_code": exit_code_for(verdict),
        "dead_letter": dict(dead_letter),
        "partitions": list(rows),
        "collected_at": dt.datetime.fromtimestamp(sampled_at, dt.timezone.utc).isoformat(),
        "history_seconds": history.span_seconds(),
        "samples": len(history.samples),
        "output": None if output is None else str(output),
        "warnings": list(warnings),
    }


def _sum_known(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


# --------------------------------------------------------------------------- rendering


def render_table(status: Mapping[str, Any]) -> str:
    """The human form: a header line, then one aligned row per partition."""
    lines = [_header(status)]
    with_output = status.get("output") is not None
    columns = ["TOPIC", "PARTITION", "COMMITTED", "END", "LAG", "LAG_S", "OWNER", "VERDICT"]
    if with_output:
        columns += ["ROWS", "INDEX", "MISMATCH"]
    table = [columns] + [_cells(row, with_output) for row in status["partitions"]]
    lines.extend(_align(table, right={1, 2, 3, 4, 5, 8, 9}))
    lines.extend(f"warning: {w}" for w in status.get("warnings", []))
    return "\n".join(lines)


def _header(status: Mapping[str, Any]) -> str:
    dead = status.get("dead_letter") or {}
    dead_count = dead.get("records")
    throughput = status.get("throughput")
    parts = [
        f"group {status['group']}",
        f"state {status.get('state', '-')}",
        f"members {len(status.get('members', []))}",
        f"total lag {status['total_lag']}",
        f"lag {_duration(status.get('max_lag_seconds'))}",
        f"throughput {'-' if throughput is None else f'{throughput:.1f}'} rec/s",
        f"ETA {_duration(status.get('eta_seconds'))}",
        f"verdict {status.get('verdict', '-')}",
        f"dead-letter {'-' if dead_count is None else dead_count} ({dead.get('topic', '-')})",
    ]
    return "  ".join(parts)


def _cells(row: Mapping[str, Any], with_output: bool) -> list[str]:
    owner = row.get("owner")
    cells = [
        row["topic"],
        str(row["partition"]),
        _dash(row["committed"]),
        str(row["end"]),
        str(row["lag"]),
        "-" if row.get("lag_seconds") is None else f"{row['lag_seconds']:.1f}",
        "-" if not owner else f"{owner['client_id']}@{owner['host']}",
        row.get("verdict", "-"),
    ]
    if with_output:
        mismatch = row.get("mismatch") or ""
        cells += [_dash(row.get("rows")), _dash(row.get("index_entries")), mismatch]
    return cells


def _align(table: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return [
        "  ".join(
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ).rstrip()
        for row in table
    ]


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


# --------------------------------------------------------------------------- watch

_CLEAR_HOME = "\x1b[H\x1b[2J"


def watch(
    kafka: KafkaSettings,
    group: str,
    interval_s: float,
    topics: Sequence[str] | None = None,
    output: Path | None = None,
    *,
    as_json: bool = False,
    dlq_topic: str | None = None,
    history: StatusHistory | None = None,
    stream: TextIO | None = None,
    max_refreshes: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any] | None:
    """Refreshes the report every `interval_s` seconds until Ctrl-C.

    On a terminal the screen is redrawn in place; otherwise (a pipe, a log)
    reports are appended, JSON ones one per line. The first failure raises (a
    wrong group or broker should fail fast); later ones are shown and retried,
    so that a broker restart does not end the watch. Returns the last report
    (None if interrupted before the first), for the caller's exit code.
    """
    if interval_s <= 0:
        raise PipelineError("--watch needs a positive number of seconds")
    out = stream if stream is not None else sys.stdout
    history = history if history is not None else StatusHistory(group=group)
    in_place = not as_json and out.isatty()
    last: dict[str, Any] | None = None
    refreshes = 0
    try:
        while max_refreshes is None or refreshes < max_refreshes:
            started = time.monotonic()
            try:
                last = collect_status(kafka, group, topics, output, history, dlq_topic=dlq_topic)
                text = json.dumps(last) if as_json else render_table(last)
            except PipelineError as exc:
                if last is None:
                    raise
                text = f"error: {exc} (retrying every {interval_s:g}s)"
            _show(out, text, in_place, interval_s, as_json)
            refreshes += 1
            if max_refreshes is None or refreshes < max_refreshes:
                sleep(max(0.0, interval_s - (time.monotonic() - started)))
    except KeyboardInterrupt:
        pass
    return last


def _show(out: TextIO, text: str, in_place: bool, interval_s: float, as_json: bool) -> None:
    if as_json:
        out.write(text + "\n")
    else:
        stamp = dt.datetime.now().strftime("%H:%M:%S")
        banner = f"every {interval_s:g}s  {stamp}  (Ctrl-C to stop)"
        out.write((_CLEAR_HOME if in_place else "") + banner + "\n" + text + "\n")
        if not in_place:
            out.write("\n")
    out.flush()
