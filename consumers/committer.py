"""The commit protocol, in one place.

For each micro-batch, in batch order:

  1. stage   every (partition, offset range) of the batch is written to a temp
             Parquet file and fsynced (`ParquetSink.stage`);
  2. dead-letter  its bad records are sent and flushed (`DeadLetterSink.send`);
  3. publish the temp files are renamed to their final names and the directory
             fsynced, but only for partitions this worker still owns in the same
             assignment epoch as when the records were polled;
  4. commit  the offset past each published range is committed to Kafka, from
             the consumer thread, again only for partitions still owned.

So an offset is committed only when every record below it is in a published
Parquet file or acknowledged by the dead-letter topic. A crash between 3 and 4
leaves files ahead of the committed offset: the output directory, not Kafka, is
the truth, and `start_positions()` (run when a partition is assigned) starts
past what is already written, so nothing lands twice.

Revocation and publication exclude each other through `Ownership`'s lock: once
`revoke()` returns, no file of those partitions will be published by this
worker, and the new owner can safely read the directory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kafka import TopicPartition
from kafka.structs import OffsetAndMetadata

from pipeline.batcher import MicroBatch, TopicPartitionKey
from sinks.layout import SegmentName, written_high_offsets

log = logging.getLogger(__name__)


class Ownership:
    """Which partitions this worker owns, and since which assignment (epoch)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._epochs: dict[TopicPartitionKey, int] = {}
        self._next_epoch = 1
        self._publishing: dict[TopicPartitionKey, int] = {}

    def assign(self, keys: Iterable[TopicPartitionKey]) -> None:
        with self._lock:
            for key in keys:
                self._epochs[key] = self._next_epoch
            self._next_epoch += 1

    def revoke(self, keys: Iterable[TopicPartitionKey]) -> None:
        """After this returns, nothing more is published for these partitions."""
        with self._lock:
            for key in keys:
                self._epochs.pop(key, None)

    def epoch(self, key: TopicPartitionKey) -> int:
        with self._lock:
            return self._epochs.get(key, 0)

    def owned(self) -> set[TopicPartitionKey]:
        with self._lock:
            return set(self._epochs)

    def still_owned(self, key: TopicPartitionKey, epoch: int) -> bool:
        return epoch != 0 and self._epochs.get(key) == epoch

    @property
    def lock(self) -> threading.Condition:
        return self._lock


@dataclass
class PublishedBatch:
    """What a finished batch lets the committer commit."""

    number: int
    next_offsets: dict[TopicPartitionKey, int]
    epochs: dict[TopicPartitionKey, int]
    rows: int
    dead_lettered: int
    dropped_partitions: set[TopicPartitionKey] = field(default_factory=set)
    opened_at: float = 0.0  # when the batch's first record was polled (monotonic)


def segment_names(batch: MicroBatch) -> list[SegmentName]:
    return [
        SegmentName(topic, partition, first, last)
        for (topic, partition), (first, last) in sorted(batch.ranges.items())
    ]


class OffsetCommitter:
    """Commits published offsets; runs on the consumer's thread only."""

    def __init__(self, consumer: object, ownership: Ownership) -> None:
        self._consumer = consumer
        self._ownership = ownership
        self._pending: dict[TopicPartitionKey, tuple[int, int]] = {}
        self.committed: dict[TopicPartitionKey, int] = {}
        self.failures = 0

    def add(self, published: PublishedBatch) -> None:
        for key, offset in published.next_offsets.items():
            epoch = published.epochs[key]
            current = self._pending.get(key)
            if current is None or offset > current[0]:
                self._pending[key] = (offset, epoch)

    def add_position(self, key: TopicPartitionKey, offset: int, epoch: int) -> None:
        self._pending[key] = (offset, epoch)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def commit(self, timeout_ms: int = 30_000) -> bool:
        """Commits pending offsets of owned partitions; False when the commit failed."""
        offsets = {}
        with self._ownership.lock:
            for key, (offset, epoch) in list(self._pending.items()):
                if self._ownership.still_owned(key, epoch):
                    offsets[TopicPartition(*key)] = OffsetAndMetadata(offset, "", -1)
                else:
                    del self._pending[key]  # the new owner starts from the files
        if not offsets:
            return True
        try:
            self._consumer.commit(offsets=offsets, timeout_ms=timeout_ms)  # type: ignore[attr-defined]
        except Exception as exc:  # CommitFailed, RebalanceInProgress, timeouts: retried later
            self.failures += 1
            log.warning("offset commit failed (will retry after the rebalance): %s", exc)
            return False
        for tp, meta in offsets.items():
            key = (tp.topic, tp.partition)
            self.committed[key] = meta.offset
            if self._pending.get(key, (None,))[0] == meta.offset:
                del self._pending[key]
        return True


def start_positions(
    output: Path, committed: dict[TopicPartitionKey, int | None]
) -> dict[TopicPartitionKey, int]:
    """Where to resume each assigned partition: past what the output already holds.

    Only partitions whose files run past the committed offset are returned;
    the others resume at their committed offset as usual.
    """
    written = written_high_offsets(output)
    positions = {}
    for key, offset in committed.items():
        last = written.get(key)
        if last is not None and (offset is None or last + 1 > offset):
            positions[key] = last + 1
    return positions
