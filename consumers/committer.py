"""The commit protocol, in one place.

For each micro-batch, in batch order:

  1. stage   the offset range of each of its partitions is written to a temp
             Parquet file and fsynced (`ParquetSink.stage`); a range covers
             every offset the consumer passed, records or not, so that
             consecutive segments of a partition tile its offsets;
  2. dead-letter  its bad records are sent and flushed (`DeadLetterSink.send`);
  3. publish each temp file is linked to its final name, create-if-absent, and
             the directory fsynced, but only for partitions this worker still
             owns in the epoch its records were polled in (`Ownership.owns`),
             and only while the group still hears from this worker;
  4. commit  the offset past each published range is committed to Kafka, from
             the consumer thread, again only for partitions still owned.

So an offset is committed only when every record below it is in a published
segment or acknowledged by the dead-letter topic. The output directory, not
Kafka, is the truth: a partition is (re)started exactly past what its segments
cover (`consumers.partitions`), so a crash between 3 and 4 leaves no duplicate.

Fencing: a segment's name is its first offset, and publishing is a
create-if-absent of that name. A worker that stalled past its session timeout
and comes back still believes it owns its partitions; the new owner started
where the outputs ended, which is where the stalled worker's next segment
starts too, so both race for the same name and exactly one wins. The loser
fences the partition (`Ownership.fence`): nothing more it polled of it is
published, and it reads the partition again from where the outputs now end.
Revocation and publication exclude each other through `Ownership.lock`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kafka import TopicPartition
from kafka.structs import OffsetAndMetadata

from consumers.partitions import Ownership
from sinks.layout import TopicPartitionKey

log = logging.getLogger(__name__)


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


class OffsetCommitter:
    """Commits published offsets; runs on the consumer's thread only."""

    def __init__(
        self,
        consumer: object,
        ownership: Ownership,
        timeout_ms: int = 10_000,
        metadata: Callable[[TopicPartitionKey], str] | None = None,
    ) -> None:
        self._consumer = consumer
        self._ownership = ownership
        self._timeout_ms = timeout_ms
        # The committed offset's metadata per partition (consumers.tiers: its tier).
        self._metadata = metadata
        self._pending: dict[TopicPartitionKey, tuple[int, int]] = {}
        self.committed: dict[TopicPartitionKey, int] = {}
        self.failures = 0
        self.failing_since: float | None = None

    def add(self, published: PublishedBatch) -> None:
        for key, offset in published.next_offsets.items():
            self.add_position(key, offset, published.epochs[key])

    def add_position(self, key: TopicPartitionKey, offset: int, epoch: int) -> None:
        """Commits `offset` for `key` on the next commit, if it moves the commit forward."""
        current = self._pending.get(key)
        if (current is None or offset > current[0]) and offset > self.committed.get(key, -1):
            self._pending[key] = (offset, epoch)

    def forget(self, keys: set[TopicPartitionKey]) -> None:
        """Partitions this worker no longer reads: their next owner commits them."""
        for key in keys:
            self._pending.pop(key, None)
            self.committed.pop(key, None)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def commit(self, now: float) -> bool:
        """Commits pending offsets of owned partitions; False when the commit failed."""
        offsets = {}
        with self._ownership.lock:
            for key, (offset, epoch) in list(self._pending.items()):
                if self._ownership.owns(key, epoch):
                    meta = "" if self._metadata is None else self._metadata(key)
                    offsets[TopicPartition(*key)] = OffsetAndMetadata(offset, meta, -1)
                else:
                    del self._pending[key]  # the next owner starts from the outputs
        if not offsets:
            return True
        try:
            self._consumer.commit(offsets=offsets, timeout_ms=self._timeout_ms)  # type: ignore[attr-defined]
        except Exception as exc:  # CommitFailed, RebalanceInProgress, broker restarts: retried
            self.failures += 1
            if self.failing_since is None:
                self.failing_since = now
            log.warning("offset commit failed (retrying): %s", exc)
            return False
        self.failing_since = None
        for tp, meta in offsets.items():
            key = (tp.topic, tp.partition)
            self.committed[key] = meta.offset
            if self._pending.get(key, (None,))[0] == meta.offset:
                del self._pending[key]
        return True
