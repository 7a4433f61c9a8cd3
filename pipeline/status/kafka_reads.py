"""What `pipeline status` reads from Kafka, through `pipeline.kafka.cluster`, fast.

A status probe must answer in seconds: clients get short bootstrap and request
timeouts, and every call shares one overall `Deadline` (about 15 s) for its
retries of retriable errors. A cluster that does not answer in time is a
`BrokerUnavailable` (exit 69), never a verdict.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition

from pipeline.core.config import KafkaSettings
from pipeline.kafka import cluster

Key = tuple[str, int]

BOOTSTRAP_TIMEOUT_MS = 5_000
REQUEST_TIMEOUT_MS = 5_000
DEFAULT_TIMEOUT_S = 15.0
TIMESTAMP_FETCH_S = 5.0
_MIN_TRY_S = 0.1


class Deadline:
    """One time budget shared by the calls of a probe."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        # Past the deadline, a call still gets one try (no retries): a fast
        # answer is still an answer.
        return max(_MIN_TRY_S, self.at - time.monotonic())


@contextmanager
def open_admin(kafka: KafkaSettings) -> Iterator[KafkaAdminClient]:
    config = {
        **cluster.client_kwargs(kafka, REQUEST_TIMEOUT_MS),
        "bootstrap_timeout_ms": BOOTSTRAP_TIMEOUT_MS,
    }
    admin = cluster.build_client(KafkaAdminClient, kafka, **config)
    try:
        yield admin
    finally:
        admin.close()


@contextmanager
def open_reader(kafka: KafkaSettings) -> Iterator[KafkaConsumer]:
    """A group-less read_committed consumer for offsets and the oldest records' timestamps."""
    with cluster.offsets_consumer(
        kafka,
        REQUEST_TIMEOUT_MS,
        bootstrap_timeout_ms=BOOTSTRAP_TIMEOUT_MS,
        auto_offset_reset="earliest",  # a position deleted by retention: next oldest
        fetch_max_wait_ms=100,
        max_partition_fetch_bytes=64 * 1024,  # one record per partition is all we need
        metrics_enabled=False,
    ) as consumer:
        yield consumer


def committed_offsets(
    admin: KafkaAdminClient, kafka: KafkaSettings, group: str, deadline: Deadline
) -> dict[Key, int]:
    found = cluster.group_offsets(admin, kafka, group, deadline.left())
    return {(tp.topic, tp.partition): offset for tp, offset in found.items()}


def committed_and_tiers(
    admin: KafkaAdminClient, kafka: KafkaSettings, group: str, deadline: Deadline
) -> tuple[dict[Key, int], dict[Key, str]]:
    """Committed offsets, and the tier (consumers.tiers) each commit's metadata names."""
    from consumers.tiers import tier_from_metadata

    found = cluster.group_commits(admin, kafka, group, deadline.left())
    offsets = {(tp.topic, tp.partition): meta.offset for tp, meta in found.items()}
    tiers = {}
    for tp, meta in found.items():
        tier = tier_from_metadata(getattr(meta, "metadata", None))
        if tier is not None:
            tiers[(tp.topic, tp.partition)] = tier
    return offsets, tiers


def partitions_of(
    admin: KafkaAdminClient, kafka: KafkaSettings, topics: Sequence[str], deadline: Deadline
) -> dict[str, list[int] | None]:
    """Partition numbers per topic; None for a topic that does not exist."""
    return cluster.describe_partitions(admin, kafka, list(dict.fromkeys(topics)), deadline.left())


def log_offsets(
    reader: KafkaConsumer, kafka: KafkaSettings, keys: Sequence[Key], deadline: Deadline
) -> tuple[dict[Key, int], dict[Key, int]]:
    """(beginning, end) offsets; the end is the last stable offset, what read_committed reaches."""
    tps = [TopicPartition(t, p) for t, p in keys]
    beginnings = cluster.beginning_offsets(reader, kafka, tps, deadline.left())
    ends = cluster.end_offsets(reader, kafka, tps, deadline.left())
    return (
        {(tp.topic, tp.partition): offset for tp, offset in beginnings.items()},
        {(tp.topic, tp.partition): offset for tp, offset in ends.items()},
    )


def dead_letter_size(
    reader: KafkaConsumer,
    kafka: KafkaSettings,
    topic: str,
    partitions: Sequence[int] | None,
    deadline: Deadline,
) -> dict[str, Any]:
    """Records in the dead-letter topic (None when it does not exist)."""
    if partitions is None:
        return {"topic": topic, "records": None}
    beginnings, ends = log_offsets(reader, kafka, [(topic, p) for p in partitions], deadline)
    return {"topic": topic, "records": sum(ends[k] - beginnings[k] for k in ends)}


def describe_group(
    admin: KafkaAdminClient, kafka: KafkaSettings, group: str, deadline: Deadline
) -> dict[str, Any]:
    """The group's state and members with their assignments (cluster.describe_group)."""
    info = cluster.describe_group(admin, kafka, group, deadline.left())
    members = [
        {
            "member_id": member.member_id,
            "client_id": member.client_id,
            "host": member.host,
            "assignments": [{"topic": t, "partition": p} for t, p in member.assignments],
        }
        for member in info.members
    ]
    return {"state": info.state, "members": members}


def oldest_timestamps(
    reader: KafkaConsumer, positions: Mapping[Key, int], budget_s: float
) -> dict[Key, int]:
    """Timestamp (ms) of the first record at or after each position.

    Assign + seek (nothing committed), one record per partition; partitions
    that give nothing within the budget are left out (their lag_seconds stays
    null). Kafka errors propagate: the caller turns them into a warning.
    """
    if not positions:
        return {}
    tps = {TopicPartition(t, p): offset for (t, p), offset in positions.items()}
    reader.assign(list(tps))
    for tp, offset in tps.items():
        reader.seek(tp, offset)
    found: dict[Key, int] = {}
    deadline = time.monotonic() + budget_s
    while len(found) < len(tps) and (left := deadline - time.monotonic()) > 0:
        batch = reader.poll(timeout_ms=int(min(left, 1.0) * 1000) + 1)
        for tp, records in batch.items():
            key = (tp.topic, tp.partition)
            if records and key not in found:
                found[key] = records[0].timestamp
                reader.pause(tp)  # stop fetching what we already have
    return {key: ts for key, ts in found.items() if ts is not None and ts >= 0}
