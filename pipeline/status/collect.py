"""One status report: Kafka reads, the output directory and verdicts, as a JSON-able dict."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import kafka.errors as kerrors
from kafka import KafkaConsumer

from pipeline.audit.run import present_topics, resolve_topics
from pipeline.core.config import KafkaSettings
from pipeline.core.errors import ConfigError
from pipeline.status import kafka_reads as reads
from pipeline.status.history import Key, StatusHistory
from pipeline.status.outputs import PartitionOutput, output_facts
from pipeline.status.tiers import apply_tiers
from pipeline.status.verdicts import (
    IDLE_STATES,
    MISMATCH,
    commit_rate,
    drain_eta,
    end_rate,
    exit_code_for,
    judge_partition,
    partition_lag,
    worst,
)


def collect_status(
    kafka: KafkaSettings,
    group: str,
    topics: Sequence[str] | None = None,
    output: Path | None = None,
    history: StatusHistory | None = None,
    *,
    dlq_topic: str | None = None,
    timeout_s: float = reads.DEFAULT_TIMEOUT_S,
    now: Callable[[], float] = time.time,
) -> dict[str, Any]:
    """One status report of `group`.

    With `topics` None, the topics the group has committed offsets for. The
    sample is added to `history` (if given) and verdicts use its trend. With
    `output`, each partition also gets what the output holds, and MISMATCH when
    its segments do not account for every committed offset. Kafka calls share
    one deadline of `timeout_s`; an unreachable cluster is BrokerUnavailable.
    """
    if not group.strip():
        raise ConfigError("give the consumer group to report on (--group)")
    deadline = reads.Deadline(timeout_s)
    warnings: list[str] = []
    with reads.open_admin(kafka) as admin:
        committed, tiers = reads.committed_and_tiers(admin, kafka, group, deadline)
        names = resolve_topics(group, topics, committed)
        # A tiered worker's dead letters go to its (first) nearline topic's .dlq.
        nearline = {t for (t, _), tier in tiers.items() if tier == "nearline"}
        dead_topic = dlq_topic or f"{next((t for t in names if t in nearline), names[0])}.dlq"
        partitions = reads.partitions_of(admin, kafka, [*names, dead_topic], deadline)
        group_info = reads.describe_group(admin, kafka, group, deadline)
    names = present_topics(names, partitions, named=topics is not None, warnings=warnings)
    keys = [(t, p) for t in names for p in partitions[t] or []]
    with reads.open_reader(kafka) as reader:
        beginnings, ends = reads.log_offsets(reader, kafka, keys, deadline)
        dead_letter = reads.dead_letter_size(
            reader, kafka, dead_topic, partitions.get(dead_topic), deadline
        )
        sampled_at = now()
        positions = _lagging_positions(keys, committed, ends, beginnings)
        timestamps = _timestamps_or_warn(reader, positions, deadline, warnings)

    history = (history or StatusHistory()).for_group(group)
    history.add(sampled_at, {k: (committed.get(k), ends[k]) for k in keys})
    facts = None
    if output is not None:
        facts, output_warnings = output_facts(output, committed, keys)
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
            _is_consumed(key, group_info, owners),
            owners.get(key),
            None if facts is None else facts[key],
        )
        for key in keys
    ]
    apply_tiers(rows, tiers)
    return _group_summary(
        group, names, rows, group_info, dead_letter, history, sampled_at, output, warnings
    )


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
    reader: KafkaConsumer,
    positions: Mapping[Key, int],
    deadline: reads.Deadline,
    warnings: list[str],
) -> dict[Key, int]:
    budget = min(reads.TIMESTAMP_FETCH_S, max(1.0, deadline.left()))
    try:
        return reads.oldest_timestamps(reader, positions, budget)
    except kerrors.KafkaError as exc:
        # Offsets are the core of the report; the time lag is a bonus.
        warnings.append(f"could not read record timestamps: {exc}")
        return {}


def _owners(members: Sequence[Mapping[str, Any]]) -> dict[Key, dict[str, Any]]:
    owners = {}
    for member in members:
        owner = {k: member[k] for k in ("member_id", "client_id", "host")}
        for assignment in member["assignments"]:
            owners[(assignment["topic"], assignment["partition"])] = owner
    return owners


def _is_consumed(key: Key, group_info: Mapping[str, Any], owners: Mapping[Key, Any]) -> bool:
    if not group_info["members"] or group_info["state"] in IDLE_STATES:
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
    consumed: bool,
    owner: dict[str, Any] | None,
    facts: PartitionOutput | None,
) -> dict[str, Any]:
    lag = partition_lag(committed, end)
    points = history.points(*key)
    rate = commit_rate(points)
    lag_verdict = judge_partition(
        points, consumed=consumed, stall_after_seconds=history.stall_after_seconds
    )
    row: dict[str, Any] = {
        "topic": key[0],
        "partition": key[1],
        "beginning": beginning,
        "committed": committed,
        "end": end,
        "lag": lag,
        "lag_seconds": _lag_seconds(lag, timestamp_ms, sampled_at),
        "owner": owner,
        "throughput": rate,
        "eta_seconds": drain_eta(lag, rate, end_rate(points)),
        "verdict": lag_verdict,
        "lag_verdict": lag_verdict,
    }
    if facts is not None:
        row.update(facts.fields())
        if facts.mismatched:
            row["verdict"] = MISMATCH  # outputs that lose or double records trump any lag
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
