"""Micro-batching: records accumulate until a batch is full by count, by tokens,
or old enough, whichever comes first; the poll loop also closes a batch early
once the consumer has caught up (`flush(CloseReason.CAUGHT_UP)`), since waiting
for records that are not there only adds latency.

A batch also records which offsets of which partitions it covers and the
assignment epoch each partition had when its records were polled, so that the
committer can tell a batch of a partition since revoked. A partition's ranges
tile its offsets: each starts where the previous one ended (`start()` sets the
first), bad records are covered like good ones, and `advance()` covers offsets
the consumer passed without a record (transaction markers, aborted or compacted
records), which may give a batch ranges and no records at all.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from pipeline.embedder import TokenIds, Tokenized
from pipeline.records import BadRecord, GoodRecord

TopicPartitionKey = tuple[str, int]
_batch_numbers = itertools.count(1)


class CloseReason(enum.Enum):
    RECORDS = "records"  # --batch-size reached
    TOKENS = "tokens"  # --max-batch-tokens reached
    BYTES = "bytes"  # --max-batch-bytes reached
    AGE = "age"  # --poll-timeout-ms after its first record
    CAUGHT_UP = "caught_up"  # a poll found nothing more to read
    SHUTDOWN = "shutdown"  # handed off as the worker drains


@dataclass
class MicroBatch:
    good: list[GoodRecord] = field(default_factory=list)
    bad: list[BadRecord] = field(default_factory=list)
    token_ids: list[TokenIds] = field(default_factory=list)
    tokens: int = 0
    value_bytes: int = 0  # of the records' values, good and bad
    # (topic, partition) -> [first offset, last offset] covered by this batch
    ranges: dict[TopicPartitionKey, list[int]] = field(default_factory=dict)
    epochs: dict[TopicPartitionKey, int] = field(default_factory=dict)
    # Why a partition's first segment starts where it does (see sinks.segments).
    start_notes: dict[TopicPartitionKey, str] = field(default_factory=dict)
    opened_at: float = 0.0
    closed_at: float = 0.0
    closed_by: CloseReason | None = None
    number: int = field(default_factory=lambda: next(_batch_numbers))

    def __len__(self) -> int:
        return len(self.good) + len(self.bad)

    def tokenized(self) -> Tokenized:
        lengths = np.fromiter((len(t) for t in self.token_ids), np.int64, len(self.token_ids))
        return Tokenized(self.token_ids, lengths, truncated=0)

    def cover(self, key: TopicPartitionKey, first: int, last: int, epoch: int) -> None:
        """Extends the partition's range to `last`; a new range starts at `first`."""
        span = self.ranges.get(key)
        if span is None:
            self.ranges[key] = [first, last]
            self.epochs[key] = epoch
        else:
            span[1] = max(span[1], last)

    def without(self, dropped: set[TopicPartitionKey]) -> MicroBatch:
        """A copy without the records of the given partitions."""
        keep = [i for i, r in enumerate(self.good) if _key(r) not in dropped]
        good = [self.good[i] for i in keep]
        bad = [b for b in self.bad if _key(b) not in dropped]
        return MicroBatch(
            good=good,
            bad=bad,
            token_ids=[self.token_ids[i] for i in keep],
            tokens=sum(len(self.token_ids[i]) for i in keep),
            value_bytes=sum(map(_size, good)) + sum(map(_size, bad)),
            ranges={k: v for k, v in self.ranges.items() if k not in dropped},
            epochs={k: v for k, v in self.epochs.items() if k not in dropped},
            start_notes={k: v for k, v in self.start_notes.items() if k not in dropped},
            opened_at=self.opened_at,
            closed_at=self.closed_at,
            closed_by=self.closed_by,
            number=self.number,
        )


def _key(record: GoodRecord | BadRecord) -> TopicPartitionKey:
    return (record.source.topic, record.source.partition)


def _size(record: GoodRecord | BadRecord) -> int:
    return len(record.source.value or b"")


class Batcher:
    """Closes micro-batches on record count, token budget, value bytes or age of the
    first record. The byte bound is the one that holds memory whatever the texts."""

    def __init__(
        self,
        max_records: int,
        max_tokens: int,
        max_wait_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_bytes: int | None = None,
    ) -> None:
        self.max_records = max_records
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._open: MicroBatch | None = None
        # Per partition, the first offset of its next range.
        self._next: dict[TopicPartitionKey, int] = {}

    @property
    def pending(self) -> int:
        """Records in the open batch."""
        return 0 if self._open is None else len(self._open)

    @property
    def is_open(self) -> bool:
        """Whether a batch is open (it may cover offsets without holding records)."""
        return self._open is not None

    def start(self, key: TopicPartitionKey, offset: int) -> None:
        """The partition's next range starts at `offset` (after an assignment)."""
        self._next[key] = offset

    def advance(self, key: TopicPartitionKey, offset: int, epoch: int) -> None:
        """Covers the partition up to `offset` - 1: offsets passed without a record."""
        first = self._next.get(key)
        if first is None or offset <= first:
            return
        self._ensure_open().cover(key, first, offset - 1, epoch)
        self._next[key] = offset

    def add(
        self,
        parsed: Iterable[tuple[GoodRecord | BadRecord, TokenIds | None]],
        epoch_of: Callable[[TopicPartitionKey], int],
    ) -> list[MicroBatch]:
        """Adds records (good ones with their token ids); returns the batches that closed."""
        closed: list[MicroBatch] = []
        for record, ids in parsed:
            n_tokens = len(ids) if ids is not None else 0
            size = _size(record)
            batch = self._open
            if batch is not None and len(batch):
                if batch.good and batch.tokens + n_tokens > self.max_tokens:
                    closed.append(self._close(CloseReason.TOKENS))
                elif self.max_bytes is not None and batch.value_bytes + size > self.max_bytes:
                    closed.append(self._close(CloseReason.BYTES))
            batch = self._ensure_open()
            batch.value_bytes += size
            key = _key(record)
            offset = record.source.offset
            batch.cover(key, self._next.get(key, offset), offset, epoch_of(key))
            self._next[key] = offset + 1
            if isinstance(record, GoodRecord):
                assert ids is not None
                batch.good.append(record)
                batch.token_ids.append(ids)
                batch.tokens += n_tokens
            else:
                batch.bad.append(record)
            if len(batch) >= self.max_records:
                closed.append(self._close(CloseReason.RECORDS))
            elif batch.tokens >= self.max_tokens:
                closed.append(self._close(CloseReason.TOKENS))
            elif self.max_bytes is not None and batch.value_bytes >= self.max_bytes:
                closed.append(self._close(CloseReason.BYTES))
        return closed

    def due(self) -> MicroBatch | None:
        """The open batch, closed, if its first record has waited long enough."""
        if self._open is not None and self._clock() - self._open.opened_at >= self.max_wait_s:
            return self._close(CloseReason.AGE)
        return None

    def seconds_until_due(self) -> float | None:
        if self._open is None:
            return None
        return max(0.0, self.max_wait_s - (self._clock() - self._open.opened_at))

    def flush(self, reason: CloseReason) -> MicroBatch | None:
        """The open batch, closed now, if there is one."""
        return self._close(reason) if self._open is not None else None

    def drop(self, partitions: set[TopicPartitionKey]) -> None:
        """Forgets open records of revoked partitions (they will be consumed again)."""
        for key in partitions:
            self._next.pop(key, None)
        if self._open is None or not partitions:
            return
        remaining = self._open.without(partitions)
        self._open = remaining if remaining.ranges else None

    def _ensure_open(self) -> MicroBatch:
        if self._open is None:
            self._open = MicroBatch(opened_at=self._clock())
        return self._open

    def _close(self, reason: CloseReason) -> MicroBatch:
        batch = self._open
        assert batch is not None
        batch.closed_at = self._clock()
        batch.closed_by = reason
        self._open = None
        return batch
