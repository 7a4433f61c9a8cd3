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

from pipeline.core.chunks import later_chunk
from pipeline.core.documents import Deletion, Keyed
from pipeline.core.records import BadRecord, GoodRecord
from pipeline.model.embedder import TokenIds, Tokenized

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
    # Upsert mode's tombstones (pipeline.core.documents): rows, never embedded.
    deleted: list[Deletion] = field(default_factory=list)
    token_ids: list[TokenIds] = field(default_factory=list)
    # Records, good, bad and deleted: a chunked record's rows count once, so that a
    # poll closes no more batches with chunks than without (--batch-size is records).
    records: int = 0
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
        return len(self.good) + len(self.bad) + len(self.deleted)

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
        deleted = [d for d in self.deleted if _key(d) not in dropped]
        return MicroBatch(
            good=good,
            bad=bad,
            deleted=deleted,
            token_ids=[self.token_ids[i] for i in keep],
            records=sum(not later_chunk(g) for g in good) + len(bad) + len(deleted),
            tokens=sum(len(self.token_ids[i]) for i in keep),
            value_bytes=sum(map(_size, good)) + sum(map(_size, bad)),  # a deletion has none
            ranges={k: v for k, v in self.ranges.items() if k not in dropped},
            epochs={k: v for k, v in self.epochs.items() if k not in dropped},
            start_notes={k: v for k, v in self.start_notes.items() if k not in dropped},
            opened_at=self.opened_at,
            closed_at=self.closed_at,
            closed_by=self.closed_by,
            number=self.number,
        )


def _key(record: Keyed) -> TopicPartitionKey:
    return (record.source.topic, record.source.partition)


def _size(record: Keyed) -> int:
    """A record's value bytes, counted at its first row (a chunked record has several)."""
    return 0 if later_chunk(record) else len(record.source.value or b"")


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
        parsed: Iterable[tuple[Keyed, TokenIds | None]],
        epoch_of: Callable[[TopicPartitionKey], int],
    ) -> list[MicroBatch]:
        """Adds records (good ones with their token ids); returns the batches that closed.

        A record joins the open batch unless its tokens or bytes would take a batch
        that holds records past its bound (then the batch closes first); a batch
        closes once it reaches a bound. Offsets are covered a run of one partition
        at a time, which is what a poll hands over."""
        pairs = parsed if isinstance(parsed, list) else list(parsed)
        closed: list[MicroBatch] = []
        start = 0
        while start < len(pairs):
            start, reason = self._fill(pairs, start, epoch_of)
            if reason is not None:
                closed.append(self._close(reason))
        return closed

    def _fill(
        self,
        pairs: list[tuple[Keyed, TokenIds | None]],
        start: int,
        epoch_of: Callable[[TopicPartitionKey], int],
    ) -> tuple[int, CloseReason | None]:
        """Adds records from `start` to the open batch (opened if need be) until one
        does not fit or the batch is full; returns where it stopped and why the
        batch must close (None: every record was added and the batch stays open)."""
        batch = self._ensure_open()
        max_records, max_tokens = self.max_records, self.max_tokens
        max_bytes = self.max_bytes if self.max_bytes is not None else float("inf")
        count, tokens, value_bytes = batch.records, batch.tokens, batch.value_bytes
        good, bad, token_ids = batch.good, batch.bad, batch.token_ids
        deleted = batch.deleted
        run: list = [None, -1, 0, 0]  # topic, partition, first and last offset of a run
        reason: CloseReason | None = None
        index = start
        while index < len(pairs):
            record, ids = pairs[index]
            n_tokens = len(ids) if ids is not None else 0
            source = record.source
            span = getattr(record, "span", None)
            # A record's chunks are one: they close a batch together, never apart.
            within = later_chunk(record)
            size = 0 if within else len(source.value or b"")
            if count and not within:
                if good and tokens + n_tokens > max_tokens:
                    reason = CloseReason.TOKENS
                    break
                if value_bytes + size > max_bytes:
                    reason = CloseReason.BYTES
                    break
            if ids is not None:
                good.append(record)  # type: ignore[arg-type]
                token_ids.append(ids)
                tokens += n_tokens
            elif type(record) is Deletion:
                deleted.append(record)
            else:
                bad.append(record)  # type: ignore[arg-type]
            count += not within
            value_bytes += size
            index += 1
            offset = source.offset
            if source.partition != run[1] or source.topic != run[0]:
                self._cover_run(batch, run, epoch_of)
                run = [source.topic, source.partition, offset, offset]
            else:
                run[3] = offset
            if span is not None and span.chunk < span.chunk_count - 1:
                continue  # its next chunk follows
            if count >= max_records:
                reason = CloseReason.RECORDS
            elif tokens >= max_tokens:
                reason = CloseReason.TOKENS
            elif value_bytes >= max_bytes:
                reason = CloseReason.BYTES
            if reason is not None:
                break
        self._cover_run(batch, run, epoch_of)
        batch.records, batch.tokens, batch.value_bytes = count, tokens, value_bytes
        return index, reason

    def _cover_run(
        self, batch: MicroBatch, run: list, epoch_of: Callable[[TopicPartitionKey], int]
    ) -> None:
        """Covers a run of one partition's records, from where its range stands."""
        if run[0] is None:
            return
        key = (run[0], run[1])
        batch.cover(key, self._next.get(key, run[2]), run[3], epoch_of(key))
        self._next[key] = run[3] + 1

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
