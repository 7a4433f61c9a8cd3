"""`pipeline offsets reset`: move a consumer group's committed offsets.

It does what `kafka-consumer-groups.sh --reset-offsets` does, through
`pipeline.kafka.cluster`: one new offset per partition from one of five modes,
clamped into the partition's [earliest, end] range, committed for the group
without joining it, read back, and refused while the group has members (a
live member would overwrite the reset with its next commit, and the broker
refuses an outsider's commit to such a group anyway). A dry run changes
nothing, so it plans with members too, and says that the reset will refuse.

The end is the last stable offset, as everywhere in the pipeline: workers read
`read_committed`, and a commit past the last stable offset would skip the
records of transactions that have yet to commit.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import kafka.errors as kerrors
from kafka import KafkaAdminClient, TopicPartition

from pipeline.core.config import KafkaSettings
from pipeline.core.errors import ConfigError, PipelineError, TopicMissing
from pipeline.core.tables import align
from pipeline.kafka import cluster

EARLIEST, LATEST, DATETIME, OFFSET, SHIFT = "earliest", "latest", "datetime", "offset", "shift"
MODE_FLAGS = {
    EARLIEST: "--to-earliest",
    LATEST: "--to-latest",
    DATETIME: "--to-datetime",
    OFFSET: "--to-offset",
    SHIFT: "--shift-by",
}
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
_MS = dt.timedelta(milliseconds=1)
# The broker's answers to an outsider's commit while the group has (or gains) a member.
_MEMBER_ERRORS = (
    kerrors.UnknownMemberIdError,
    kerrors.IllegalGenerationError,
    kerrors.RebalanceInProgressError,
    kerrors.FencedInstanceIdError,
    kerrors.NonEmptyGroupError,
    kerrors.StaleMemberEpochError,
)
_MEMBERS_SHOWN = 5


class GroupActive(PipelineError):
    """The group has members: its offsets can only move once its consumers stopped."""

    exit_code = 75  # EX_TEMPFAIL: stop the workers, then run it again


@dataclass(frozen=True)
class ResetMode:
    """How the new offsets are chosen; `value` is the time (ms), offset or shift."""

    kind: str
    value: int = 0


@dataclass(frozen=True)
class TopicSpec:
    """A `--topic` argument: TOPIC, or TOPIC:0,2 for some of its partitions."""

    topic: str
    partitions: tuple[int, ...] | None = None


@dataclass(frozen=True)
class PartitionReset:
    """One partition's move; `requested` is the target before clamping."""

    topic: str
    partition: int
    current: int | None
    new: int
    earliest: int
    end: int
    requested: int
    note: str = ""

    @property
    def clamped(self) -> bool:
        return self.new != self.requested

    @property
    def change(self) -> int | None:
        """New minus current: records skipped (positive) or read again (negative)."""
        return None if self.current is None else self.new - self.current

    def as_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "current": self.current,
            "new": self.new,
            "change": self.change,
            "earliest": self.earliest,
            "end": self.end,
            "requested": self.requested,
            "clamped": self.clamped,
            "note": self.note or None,
        }


@dataclass(frozen=True)
class ResetResult:
    group: str
    partitions: list[PartitionReset]
    committed: bool  # False for a dry run
    # A dry run's group while it has members (or is between states); None when Empty.
    active: cluster.GroupInfo | None = None

    def summary(self) -> str:
        count = f"group {self.group}, {len(self.partitions)} partition(s)"
        if self.committed:
            return f"committed: {count}, read back from the broker"
        if self.active is None:
            return f"dry run: nothing changed ({count})"
        return f"dry run: nothing changed ({count}); {_active_line(self.group, self.active)}"


# --------------------------------------------------------------------------- arguments


def choose_mode(
    to_earliest: bool,
    to_latest: bool,
    to_datetime: str | None,
    to_offset: int | None,
    shift_by: int | None,
) -> ResetMode:
    """The one mode the flags name; ConfigError for none or several."""
    given = [
        mode
        for mode, value in (
            (ResetMode(EARLIEST), to_earliest),
            (ResetMode(LATEST), to_latest),
            (ResetMode(DATETIME), to_datetime is not None),
            (ResetMode(OFFSET, to_offset or 0), to_offset is not None),
            (ResetMode(SHIFT, shift_by or 0), shift_by is not None),
        )
        if value
    ]
    if len(given) != 1:
        flags = ", ".join(MODE_FLAGS.values())
        named = ", ".join(MODE_FLAGS[m.kind] for m in given) or "none"
        raise ConfigError(f"give exactly one of {flags} (given: {named})")
    if given[0].kind == DATETIME:
        assert to_datetime is not None
        return ResetMode(DATETIME, parse_datetime(to_datetime))
    return given[0]


def parse_datetime(text: str) -> int:
    """Milliseconds since the epoch of an ISO 8601 date-time; no timezone means UTC."""
    raw = text.strip()
    if raw[-1:] in ("Z", "z"):
        raw = raw[:-1] + "+00:00"  # Python 3.10's fromisoformat knows no Z
    try:
        moment = dt.datetime.fromisoformat(raw)
    except ValueError as exc:
        raise ConfigError(
            f"--to-datetime {text!r} is not an ISO 8601 date-time "
            "(e.g. 2024-05-01T12:00:00Z, 2024-05-01T14:00:00+02:00, 2024-05-01)"
        ) from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.timezone.utc)
    # Rounded up: record timestamps are whole milliseconds, and a record from
    # before the given time must not be included because of the rounding.
    millis = -(-(moment - _EPOCH) // _MS)
    if millis < 0:
        raise ConfigError(f"--to-datetime {text!r} is before 1970, which Kafka cannot look up")
    return millis


def parse_topic_spec(spec: str) -> TopicSpec:
    """TOPIC or TOPIC:0,2 (the format of kafka-consumer-groups.sh --topic)."""
    # Topic names cannot hold ':', so the first one separates the partitions.
    topic, sep, numbers = spec.strip().partition(":")
    if not topic:
        raise ConfigError(f"--topic {spec!r} names no topic; give TOPIC or TOPIC:0,2")
    if not sep:
        return TopicSpec(topic)
    try:
        partitions = tuple(sorted({int(n) for n in numbers.split(",") if n.strip()}))
    except ValueError as exc:
        raise ConfigError(
            f"--topic {spec!r}: partitions must be numbers, as in {topic}:0,2"
        ) from exc
    if not partitions or partitions[0] < 0:
        raise ConfigError(f"--topic {spec!r}: give partition numbers, as in {topic}:0,2")
    return TopicSpec(topic, partitions)


# --------------------------------------------------------------------------- planning


def plan_partition(
    tp: TopicPartition,
    mode: ResetMode,
    current: int | None,
    earliest: int,
    end: int,
    at_time: int | None = None,
) -> PartitionReset:
    """One partition's new offset: the mode's target, clamped into [earliest, end].

    `at_time` is the first offset at or after the time (DATETIME), None past the
    last record. A partition without a committed offset is shifted from its
    earliest offset: that is where a worker with no output starts it.
    """
    note = ""
    if mode.kind == EARLIEST:
        requested = earliest
    elif mode.kind == LATEST:
        requested = end
    elif mode.kind == DATETIME:
        requested = end if at_time is None else at_time
        note = "no record at or after the time: end" if at_time is None else ""
    elif mode.kind == OFFSET:
        requested = mode.value
    elif mode.kind == SHIFT:
        requested = (earliest if current is None else current) + mode.value
        note = "nothing committed: shifted from earliest" if current is None else ""
    else:
        raise ValueError(f"unknown reset mode {mode.kind!r}")
    new = min(max(requested, earliest), end)
    if new != requested:
        bound = "earliest" if requested < earliest else "end"
        note = "; ".join(filter(None, (note, f"clamped to {bound} (asked {requested})")))
    return PartitionReset(tp.topic, tp.partition, current, new, earliest, end, requested, note)


def select_partitions(
    specs: Sequence[TopicSpec], found: Mapping[str, list[int] | None]
) -> list[TopicPartition]:
    """The partitions the specs name; TopicMissing for a topic or partition that is not there."""
    missing = sorted({s.topic for s in specs if found.get(s.topic) is None})
    if missing:
        raise TopicMissing(
            f"topic(s) {', '.join(missing)} do not exist; check the name, or create it with: "
            "pipeline topics create TOPIC --partitions N"
        )
    chosen: set[TopicPartition] = set()
    for spec in specs:
        existing = found[spec.topic] or []
        wanted = existing if spec.partitions is None else list(spec.partitions)
        absent = sorted(set(wanted) - set(existing))
        if absent:
            raise TopicMissing(
                f"topic {spec.topic} has no partition {', '.join(map(str, absent))} "
                f"(it has {len(existing)}: 0-{len(existing) - 1})"
            )
        chosen.update(TopicPartition(spec.topic, p) for p in wanted)
    return sorted(chosen)


# --------------------------------------------------------------------------- the reset


def reset_offsets(
    kafka: KafkaSettings,
    group: str,
    specs: Sequence[TopicSpec],
    mode: ResetMode,
    *,
    dry_run: bool = False,
) -> ResetResult:
    """Plans the new offsets of `group` and, unless `dry_run`, commits and reads them back."""
    if not group.strip():
        raise ConfigError("give the consumer group whose offsets to reset (--group)")
    if not specs:
        raise ConfigError("give at least one --topic")
    with cluster.admin_client(kafka) as admin:
        # Checked first: nothing is read for a reset that would be refused. A dry run
        # changes nothing, so it plans anyway and says that the reset would refuse.
        info = cluster.describe_group(admin, kafka, group)
        refusal = active_refusal(group, info)
        if refusal is not None and not dry_run:
            raise refusal
        found = cluster.describe_partitions(
            admin, kafka, list(dict.fromkeys(s.topic for s in specs))
        )
        partitions = select_partitions(specs, found)
        current = cluster.group_offsets(admin, kafka, group)
        plan = _plan(kafka, partitions, current, mode)
        if not dry_run:
            _commit(admin, kafka, group, plan)
            _verify(admin, kafka, group, plan)
    return ResetResult(
        group, plan, committed=not dry_run, active=info if refusal is not None else None
    )


def active_refusal(group: str, info: cluster.GroupInfo) -> GroupActive | None:
    """The error a reset of a group with members (or between states) fails with."""
    if not info.active:
        return None
    if not info.members:
        return GroupActive(
            f"group {group} is {info.state}, not Empty: its consumers are joining or leaving; "
            "stop its workers (pipeline run) and run the reset again"
        )
    return GroupActive(
        f"group {group} has {len(info.members)} active member(s) ({_member_names(info)}; "
        f"state {info.state}): stop its workers (pipeline run) first, then run the reset "
        "again (a killed worker stays a member until its session times out)"
    )


def _member_names(info: cluster.GroupInfo) -> str:
    names = [f"{m.client_id}@{m.host}" for m in info.members]
    more = f" and {len(names) - _MEMBERS_SHOWN} more" if len(names) > _MEMBERS_SHOWN else ""
    return ", ".join(names[:_MEMBERS_SHOWN]) + more


def _active_line(group: str, info: cluster.GroupInfo) -> str:
    """What a dry run says of a group the reset itself would refuse."""
    if not info.members:
        return (
            f"group {group} is {info.state}, not Empty: the reset without --dry-run will refuse "
            "until its consumers have stopped"
        )
    return (
        f"the group has {len(info.members)} active member(s) ({_member_names(info)}; state "
        f"{info.state}): the reset without --dry-run will refuse until they stop, and their "
        "commits may move the current offsets meanwhile"
    )


def _plan(
    kafka: KafkaSettings,
    partitions: list[TopicPartition],
    current: Mapping[TopicPartition, int],
    mode: ResetMode,
) -> list[PartitionReset]:
    with cluster.offsets_consumer(kafka) as reader:
        earliest = cluster.beginning_offsets(reader, kafka, partitions)
        ends = cluster.end_offsets(reader, kafka, partitions)
        at_time: Mapping[TopicPartition, int | None] = {}
        if mode.kind == DATETIME:
            at_time = cluster.offsets_for_times(
                reader, kafka, dict.fromkeys(partitions, mode.value)
            )
    return [
        plan_partition(tp, mode, current.get(tp), earliest[tp], ends[tp], at_time.get(tp))
        for tp in partitions
    ]


def _commit(
    admin: KafkaAdminClient, kafka: KafkaSettings, group: str, plan: Sequence[PartitionReset]
) -> None:
    offsets = {TopicPartition(r.topic, r.partition): r.new for r in plan}
    refused = cluster.commit_group_offsets(admin, kafka, group, offsets)
    if not refused:
        return
    first_tp, first_error = sorted(refused.items())[0]
    if any(issubclass(err, _MEMBER_ERRORS) for err in refused.values()):
        raise GroupActive(
            f"group {group} gained a member while resetting (the broker answered "
            f"{first_error.__name__}); stop its workers (pipeline run) and run the reset again"
        )
    raise PipelineError(
        f"committing offsets of group {group}: Kafka refused {len(refused)} partition(s), "
        f"e.g. {first_tp.topic}[{first_tp.partition}] ({first_error.__name__})"
    )


def _verify(
    admin: KafkaAdminClient, kafka: KafkaSettings, group: str, plan: Sequence[PartitionReset]
) -> None:
    # The broker said yes; reading the offsets back also catches a client that
    # committed for the group between our commit and now.
    back = cluster.group_offsets(admin, kafka, group)
    wrong = [
        f"{r.topic}[{r.partition}] is at {back.get(TopicPartition(r.topic, r.partition))}, "
        f"not {r.new}"
        for r in plan
        if back.get(TopicPartition(r.topic, r.partition)) != r.new
    ]
    if wrong:
        raise PipelineError(
            f"group {group}'s offsets read back differ from the reset ({'; '.join(wrong[:3])}): "
            "another client committed for the group meanwhile; stop it and reset again"
        )


# --------------------------------------------------------------------------- output


def render_table(result: ResetResult) -> str:
    rows = [["TOPIC", "PARTITION", "CURRENT-OFFSET", "NEW-OFFSET", "CHANGE", "NOTE"]]
    rows += [
        [
            r.topic,
            str(r.partition),
            "-" if r.current is None else str(r.current),
            str(r.new),
            "-" if r.change is None else f"{r.change:+d}" if r.change else "0",
            r.note,
        ]
        for r in result.partitions
    ]
    return "\n".join(align(rows, right={1, 2, 3, 4}))
