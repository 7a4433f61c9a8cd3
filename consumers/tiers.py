"""Priority tiers: one worker serves nearline topics before backfill topics.

`pipeline run --topic live --backfill-topic corpus` subscribes the group to both
and serves `live` first. Four things make a nearline record wait for little
backfill work, and none of them touches the commit protocol (offsets still
commit only past durable outputs, and every assignment still starts where the
outputs end):

- **Backfill waits while nearline has lag.** The lag is read from the consumer's
  own state, with no request: per assigned nearline partition, the high watermark
  its last fetch returned minus its position (records fetched, or fetchable, but
  not taken yet). At `pause_at` records the backfill partitions are paused
  (`consumer.pause`); they resume once the lag has stayed at zero for
  `resume_after_s` (hysteresis: a trickle of nearline records does not flap them,
  and backfill never starves while nearline keeps up). The wanted pauses are
  reconciled against the consumer's own paused set on every turn of the poll loop
  and right after each rebalance (`Reader.pause_only`): newly assigned backfill
  partitions wait too, revoked ones are forgotten, and kafka-python keeps what it
  had already fetched of a paused partition for when it resumes.
- **Backfill batches are short.** A backfill batch closes at about
  `--backfill-batch-ms` of embedding (records/s measured on the worker's own
  backfill batches, `EmbedRate`), and a poll takes no more records than one such
  batch while any backfill partition is fetchable; so the backfill work ahead of a
  nearline record is at most the batch being embedded.
- **Nearline batches go first** in the embed queue (`TierQueue`), and a backfill
  batch being embedded gives way to them between its forward passes: on a squeezed
  CPU a backfill batch takes longer, but a nearline record still waits for at most
  one pass per replica of it. A new nearline batch closes only once the previous
  one is being embedded (so a trickle on a busy CPU makes few batches, not one per
  poll); batches never mix tiers (`TieredBatcher`), and a partition has one tier,
  so each partition's batches still reach the writer in order.
- **Every backfill partition advances** (`FairShare`): a partition that has given
  a backfill batch's worth more than the one furthest behind pauses until that one
  catches up, so no partition waits for another to drain.
- **Each tier has `--max-in-flight` batches of its own** before its partitions
  pause: a nearline trickle closes a small batch at every poll, and with shared
  slots those would keep the backfill paused for good.

Tiers are per worker: in a group, the assignor may leave one worker with
backfill partitions only, and that worker runs them at full speed. The tier of
each partition rides on its committed offset's metadata (`tier=nearline`,
`tier=backfill`), which `pipeline status` shows.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import kafka.errors as kerrors
from kafka import KafkaConsumer, TopicPartition

from consumers.batcher import Batcher, CloseReason, MicroBatch, TopicPartitionKey
from pipeline.core.records import BadRecord, GoodRecord
from pipeline.model.embedder import TokenIds

log = logging.getLogger(__name__)

NEARLINE = "nearline"
BACKFILL = "backfill"
TIERS = (NEARLINE, BACKFILL)
_METADATA_PREFIX = "tier="

# Backfill pauses at this much nearline lag (records) ...
PAUSE_AT = 1
# ... and resumes once the lag has stayed at zero this long.
RESUME_AFTER_S = 1.0
# A wait is logged at INFO once it has lasted this long, and then its end too; shorter
# ones (a nearline trickle makes one per record) at DEBUG, counted in the next INFO line.
LASTING_WAIT_S = 10.0
# Backfill batch size before the embed rate is known, and its floor after.
INITIAL_BACKFILL_RECORDS = 64
MIN_BACKFILL_RECORDS = 16


def commit_metadata(tier: str) -> str:
    """The committed offset's metadata that names a partition's tier."""
    return f"{_METADATA_PREFIX}{tier}"


def tier_from_metadata(metadata: str | None) -> str | None:
    """The tier a committed offset's metadata names; None when it names none."""
    if metadata and metadata.startswith(_METADATA_PREFIX):
        tier = metadata[len(_METADATA_PREFIX) :]
        return tier if tier in TIERS else None
    return None


class EmbedRate:
    """Records per second through the embed stage, over recent batches.

    A ratio of decayed sums (records, seconds), so that a batch weighs by its
    size: a one-record nearline batch barely moves it. One thread adds (the
    embed stage), another reads (the poll loop).
    """

    def __init__(self, decay: float = 0.7) -> None:
        self.decay = decay
        self._records = 0.0
        self._seconds = 0.0
        self._lock = threading.Lock()

    def add(self, records: int, seconds: float) -> None:
        if records <= 0 or seconds <= 0:
            return
        with self._lock:
            self._records = self._records * self.decay + records
            self._seconds = self._seconds * self.decay + seconds

    def records_per_s(self) -> float | None:
        with self._lock:
            return self._records / self._seconds if self._seconds > 0 else None


class Tiers:
    """Which partitions are backfill, and whether backfill waits (with hysteresis)."""

    def __init__(
        self,
        backfill_topics: Iterable[str],
        batch_budget_s: float,
        max_records: int,
        *,
        pause_at: int = PAUSE_AT,
        resume_after_s: float = RESUME_AFTER_S,
        lasting_wait_s: float = LASTING_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backfill_topics = frozenset(backfill_topics)
        self.batch_budget_s = batch_budget_s
        self.max_records = max_records
        self.pause_at = max(1, pause_at)
        self.resume_after_s = resume_after_s
        self.rate = EmbedRate()
        self._clock = clock
        self.waiting = False  # backfill waits for nearline
        self.pauses = 0  # how many times it started waiting
        self._waiting_since = 0.0
        self._lag_zero_since: float | None = None
        self.lasting_wait_s = lasting_wait_s
        self._wait_logged = False  # the current wait has had its INFO line
        self._short_waits = 0  # waits logged at DEBUG only, since the last INFO line

    # -- tiers of partitions ----------------------------------------------------------

    def tier_of(self, key: TopicPartitionKey | TopicPartition) -> str:
        topic = key.topic if isinstance(key, TopicPartition) else key[0]
        return BACKFILL if topic in self.backfill_topics else NEARLINE

    def is_backfill(self, key: TopicPartitionKey | TopicPartition) -> bool:
        return self.tier_of(key) == BACKFILL

    def commit_metadata(self, key: TopicPartitionKey) -> str:
        return commit_metadata(self.tier_of(key))

    def holds_backfill(self, keys: Iterable[TopicPartitionKey]) -> bool:
        """Whether a batch covering these partitions is a backfill batch."""
        return any(self.is_backfill(key) for key in keys)

    def embedded(self, batch: MicroBatch, seconds: float) -> None:
        """The embed stage's report of a batch: backfill ones (the size this class
        chooses) measure the rate; a one-record nearline batch would only tell the
        cost of a pass."""
        if self.holds_backfill(batch.ranges):
            self.rate.add(len(batch.good), seconds)

    def split(self, partitions: Iterable[TopicPartition]) -> tuple[set[Any], set[Any]]:
        """(nearline, backfill) partitions."""
        nearline: set[TopicPartition] = set()
        backfill: set[TopicPartition] = set()
        for tp in partitions:
            (backfill if self.is_backfill(tp) else nearline).add(tp)
        return nearline, backfill

    # -- the pause decision -----------------------------------------------------------

    def observe(self, nearline_lag: int) -> bool:
        """Takes the current nearline lag; returns whether backfill waits now."""
        now = self._clock()
        if nearline_lag >= self.pause_at:
            self._lag_zero_since = None
            if not self.waiting:
                self.waiting = True
                self.pauses += 1
                self._waiting_since = now
                self._wait_logged = False
                log.debug("backfill waits: nearline lag %d", nearline_lag)
        elif nearline_lag > 0:
            self._lag_zero_since = None  # below the threshold, not yet caught up
        elif self._lag_zero_since is None:
            self._lag_zero_since = now
        if not self.waiting:
            return False
        if self._lag_zero_since is not None and now - self._lag_zero_since >= self.resume_after_s:
            self._resume(now)
            return False
        if not self._wait_logged and now - self._waiting_since >= self.lasting_wait_s:
            self._log_lasting_wait(now, nearline_lag)
        return True

    def _log_lasting_wait(self, now: float, nearline_lag: int) -> None:
        """The INFO line of a wait that lasts, counting the short ones before it."""
        self._wait_logged = True
        shorter = self._short_waits
        self._short_waits = 0
        log.info(
            "backfill waits: nearline lag %d for %.0fs%s",
            nearline_lag,
            now - self._waiting_since,
            f"; {shorter} shorter waits since the last such line" if shorter else "",
        )

    def _resume(self, now: float) -> None:
        """Logs the end of a wait at the level its start was logged at."""
        self.waiting = False
        if not self._wait_logged:
            self._short_waits += 1
        log.log(
            logging.INFO if self._wait_logged else logging.DEBUG,
            "backfill resumes: nearline caught up (it waited %.1fs)",
            now - self._waiting_since,
        )

    # -- backfill batch size ----------------------------------------------------------

    def backfill_records(self) -> int:
        """Records per backfill batch: about `batch_budget_s` of embedding."""
        rate = self.rate.records_per_s()
        if rate is None:
            return min(INITIAL_BACKFILL_RECORDS, self.max_records)
        return max(MIN_BACKFILL_RECORDS, min(self.max_records, int(rate * self.batch_budget_s)))


def fetch_lag(consumer: KafkaConsumer, partitions: Iterable[TopicPartition]) -> int:
    """Records fetched or fetchable but not yet taken: high watermark minus position,
    summed, from the consumer's own state (no request). Partitions not fetched yet
    (no high watermark) count zero."""
    return sum(partition_lags(consumer, partitions).values())


def partition_lags(
    consumer: KafkaConsumer, partitions: Iterable[TopicPartition]
) -> dict[TopicPartition, int]:
    """`fetch_lag` per partition."""
    lags = {}
    for tp in partitions:
        try:
            highwater = consumer.highwater(tp)
            if highwater is None:
                continue
            position = consumer.position(tp, timeout_ms=0)
        except kerrors.KafkaError:  # unassigned meanwhile (IllegalStateError), no position yet
            continue
        if position is not None:
            lags[tp] = max(0, highwater - position)
    return lags


class FairShare:
    """Every backfill partition with records to read advances, none waits for another.

    kafka-python hands a poll's records out of one partition's fetch (up to
    max_partition_fetch_bytes, thousands of short records) before the next
    partition's; at backfill's pace, and with polls capped at one short backfill
    batch, the other partitions' lag stood still for minutes. So the records taken
    from each lagging partition are counted, and a partition a `quantum` ahead of
    the one furthest behind is paused until that one catches up (kafka-python keeps
    what it had fetched of it). A partition whose fetch has not been handed out yet
    counts as lagging (kafka-python learns its high watermark only then, so only
    pausing the others lets it through). The counts start again whenever the set of
    lagging partitions changes, so a partition that was idle gets no credit to spend.
    """

    def __init__(self) -> None:
        self._lagging: frozenset[TopicPartitionKey] = frozenset()
        self._taken: collections.Counter[TopicPartitionKey] = collections.Counter()

    def took(self, key: TopicPartitionKey, records: int) -> None:
        if key in self._lagging:
            self._taken[key] += records

    def ahead(self, lags: dict[TopicPartition, int], quantum: int) -> set[TopicPartition]:
        """The lagging partitions to pause now, given each one's lag."""
        lagging = {(tp.topic, tp.partition): tp for tp, lag in lags.items() if lag > 0}
        if frozenset(lagging) != self._lagging:
            self._lagging = frozenset(lagging)
            self._taken = collections.Counter()
        if len(lagging) < 2:
            return set()
        floor = min(self._taken[key] for key in lagging)
        return {tp for key, tp in lagging.items() if self._taken[key] - floor >= quantum}


class TierQueue(queue.Queue):
    """The embed stage's inbox: nearline batches first, each tier FIFO.

    Strict priority: a backfill batch is taken only when no nearline batch waits,
    and a backfill batch being embedded gives way to the nearline batches that
    arrive meanwhile between its forward passes (`take_nearline`, the embed stage's
    `urgent`), so a nearline record waits for at most one pass per replica of
    backfill work, however slow the CPU has become. Backfill progresses whenever
    nearline leaves the CPU free: the worker closes a new nearline batch only once
    the one waiting here has been taken (`nearline_waiting`), so a trickle on a
    busy CPU makes few batches, not one per poll.

    A partition has one tier and a batch one tier, so every partition's batches
    still leave in the order they came.
    """

    def __init__(self, maxsize: int, is_backfill: Callable[[Any], bool]) -> None:
        self._is_backfill = is_backfill
        super().__init__(maxsize)

    def _init(self, maxsize: int) -> None:
        self._first: collections.deque[Any] = collections.deque()
        self._later: collections.deque[Any] = collections.deque()

    def _qsize(self) -> int:
        return len(self._first) + len(self._later)

    def _put(self, item: Any) -> None:
        (self._later if self._is_backfill(item) else self._first).append(item)

    def _get(self) -> Any:
        return (self._first or self._later).popleft()

    def take_nearline(self) -> Any | None:
        """The first nearline batch waiting, taken; None when none waits (no wait)."""
        with self.not_empty:
            if not self._first:
                return None
            item = self._first.popleft()
            self.not_full.notify()
            return item

    def nearline_waiting(self) -> bool:
        """Whether a nearline batch waits here, not yet taken by the embed stage."""
        with self.mutex:
            return bool(self._first)


def batch_is_backfill(tiers: Tiers) -> Callable[[Any], bool]:
    def is_backfill(batch: Any) -> bool:
        return tiers.holds_backfill(getattr(batch, "ranges", None) or {})

    return is_backfill


class TieredBatcher:
    """Two batchers, one per tier, behind the Batcher interface the worker uses.

    Batches never mix tiers. `flush()` closes one open batch per call (nearline
    first), so callers that must close everything call it until it returns None.
    """

    def __init__(
        self, tiers: Tiers, make: Callable[[], Batcher], nearline: Batcher | None = None
    ) -> None:
        self.tiers = tiers
        self.nearline = make() if nearline is None else nearline
        self.backfill = make()
        # While true, the open nearline batch does not close by age (the worker: a
        # nearline batch still waits for the embed stage); its size limits still apply.
        self.hold_nearline: Callable[[], bool] = lambda: False

    @classmethod
    def around(cls, tiers: Tiers, batcher: Batcher) -> TieredBatcher:
        """`batcher` for nearline, and one with the same limits for backfill."""
        return cls(
            tiers,
            lambda: Batcher(
                batcher.max_records,
                batcher.max_tokens,
                batcher.max_wait_s,
                clock=getattr(batcher, "_clock", time.monotonic),
                max_bytes=batcher.max_bytes,
            ),
            nearline=batcher,
        )

    def of(self, key: TopicPartitionKey) -> Batcher:
        return self.backfill if self.tiers.is_backfill(key) else self.nearline

    def by_tier(self) -> list[tuple[str, Batcher]]:
        return [(NEARLINE, self.nearline), (BACKFILL, self.backfill)]

    @property
    def pending(self) -> int:
        return self.nearline.pending + self.backfill.pending

    @property
    def is_open(self) -> bool:
        return self.nearline.is_open or self.backfill.is_open

    def start(self, key: TopicPartitionKey, offset: int) -> None:
        self.of(key).start(key, offset)

    def advance(self, key: TopicPartitionKey, offset: int, epoch: int) -> None:
        self.of(key).advance(key, offset, epoch)

    def add(
        self,
        parsed: Iterable[tuple[GoodRecord | BadRecord, TokenIds | None]],
        epoch_of: Callable[[TopicPartitionKey], int],
    ) -> list[MicroBatch]:
        nearline: list[tuple[GoodRecord | BadRecord, TokenIds | None]] = []
        backfill: list[tuple[GoodRecord | BadRecord, TokenIds | None]] = []
        for pair in parsed:
            source = pair[0].source
            (backfill if source.topic in self.tiers.backfill_topics else nearline).append(pair)
        closed = self.nearline.add(nearline, epoch_of) if nearline else []
        if backfill:
            closed += self.backfill.add(backfill, epoch_of)
        return closed

    def due(self) -> MicroBatch | None:
        # `is None`, not `or`: a batch may cover offsets and hold no record (len 0).
        batch = None if self.hold_nearline() else self.nearline.due()
        return self.backfill.due() if batch is None else batch

    def seconds_until_due(self) -> float | None:
        held = self.hold_nearline()  # a held batch is not due: no busy polling for it
        waits = [b.seconds_until_due() for b in ([] if held else [self.nearline])]
        waits.append(self.backfill.seconds_until_due())
        known = [w for w in waits if w is not None]
        return min(known) if known else None

    def flush(self, reason: CloseReason) -> MicroBatch | None:
        batch = self.nearline.flush(reason)
        return self.backfill.flush(reason) if batch is None else batch

    def drop(self, partitions: set[TopicPartitionKey]) -> None:
        self.nearline.drop(partitions)
        self.backfill.drop(partitions)
