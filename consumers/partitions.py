"""The rebalance state machine, in one place: which partitions this worker owns,
where it reads each of them from, and what it may still publish.

Three threads touch partition state, each through its own door:

- kafka-python's IO thread runs the rebalance listener (`Listener`): it may
  only change ownership (`Ownership.assigned` / `revoked`) and queue an event;
- the write thread asks `Ownership.owns()` before each publish, and calls
  `Ownership.fence()` when it lost a publish race, which also queues an event;
- the poll thread (`Reader`) applies the queued events right after each poll,
  before it looks at the polled records: it seeks every assigned (or fenced)
  partition to exactly where the outputs end, forgets what it had polled of
  it, and only then tags new records with the partition's new epoch.

Epochs: every assignment of a partition to this worker, and every fence, gives
it a new epoch. A batch remembers the epoch under which each of its partitions
was polled, and its files are published only while that epoch is current,
checked under the same lock that revocation takes: once `revoked()` returns,
nothing more is published for those partitions by this worker.

Start positions (the restart mechanism): a partition starts exactly past what
the output directory holds, or at the group's committed offset when the
directory holds nothing of it, or at its first offset when neither exists.
Kept partitions are sought too (an eager rebalance keeps kafka-python's fetch
position, and with it any batches this worker dropped), and pauses are not
remembered here but reconciled against the consumer's own paused set.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import kafka.errors as kerrors
from kafka import ConsumerRebalanceListener, KafkaConsumer, TopicPartition

from pipeline.core.config import KafkaSettings
from pipeline.core.layout import TopicPartitionKey, segments_by_partition
from pipeline.core.records import Source
from pipeline.kafka import cluster, internals
from sinks.segments import START_FROM_COMMITTED, DamagedSegment, covered_through, quarantine

log = logging.getLogger(__name__)
S = TypeVar("S", bound=Source)


class Change(enum.Enum):
    ASSIGNED = "assigned"
    REVOKED = "revoked"
    LOST = "lost"
    FENCED = "fenced"  # a publish race lost: re-read where the outputs end


@dataclass(frozen=True)
class Event:
    change: Change
    keys: frozenset[TopicPartitionKey]


class InFlight:
    """Batches handed to the stages and not yet published, with their partitions.

    `wait_for(partitions)` lets a revocation give the embedded batches on those
    partitions (being written: published within moments) a bounded time to be
    published before the partitions go. Batches not embedded yet are not waited
    for: a backlog's batch takes seconds to embed, and every second a revocation
    waits, the group waits too (the next owner reads them again from the outputs).
    """

    def __init__(self, lock: threading.Condition) -> None:
        self._cond = lock
        self._batches: dict[int, set[TopicPartitionKey]] = {}
        self._embedded: set[int] = set()

    def started(self, number: int, keys: Iterable[TopicPartitionKey]) -> None:
        with self._cond:
            self._batches[number] = set(keys)

    def embedded(self, number: int) -> None:
        with self._cond:
            if number in self._batches:
                self._embedded.add(number)

    def finished(self, number: int) -> None:
        with self._cond:
            self._batches.pop(number, None)
            self._embedded.discard(number)
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._batches)

    def wait_fewer_than(self, count: int, timeout_s: float) -> bool:
        """Waits until fewer than `count` batches are out; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._batches) < count, timeout=timeout_s)

    def count(self, where: Callable[[set[TopicPartitionKey]], bool]) -> int:
        """Batches whose partitions satisfy `where` (consumers.tiers: backfill ones)."""
        with self._cond:
            return sum(1 for keys in self._batches.values() if where(keys))

    def clear(self) -> None:
        with self._cond:
            self._batches.clear()
            self._embedded.clear()
            self._cond.notify_all()

    def wait_for(self, partitions: set[TopicPartitionKey], timeout_s: float) -> bool:
        """Until no embedded batch holds these partitions; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not any(self._batches[n] & partitions for n in self._embedded),
                timeout=timeout_s,
            )


class Ownership:
    """Which partitions this worker owns, and in which epoch (the authoritative view)."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.in_flight = InFlight(self.lock)
        self._epochs: dict[TopicPartitionKey, int] = {}
        self._next_epoch = 1
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()

    # -- kafka-python's IO thread (the listener) ------------------------------------------

    def assigned(self, keys: Iterable[TopicPartitionKey]) -> None:
        keys = frozenset(keys)
        with self.lock:
            for key in keys:
                self._epochs[key] = self._new_epoch()
        self._events.put(Event(Change.ASSIGNED, keys))

    def revoked(self, keys: Iterable[TopicPartitionKey], lost: bool) -> None:
        """After this returns, nothing more is published for these partitions."""
        keys = frozenset(keys)
        with self.lock:
            for key in keys:
                self._epochs.pop(key, None)
        self._events.put(Event(Change.LOST if lost else Change.REVOKED, keys))

    # -- the write thread -----------------------------------------------------------------

    def owns(self, key: TopicPartitionKey, epoch: int) -> bool:
        """Whether a batch polled in `epoch` may still be published (call under `lock`)."""
        return epoch != 0 and self._epochs.get(key) == epoch

    def fence(self, key: TopicPartitionKey, epoch: int) -> None:
        """Stops publishing what was polled in `epoch`; the poll loop re-reads the outputs."""
        with self.lock:
            if self._epochs.get(key) != epoch:
                return  # already revoked or fenced
            self._epochs[key] = self._new_epoch()
        self._events.put(Event(Change.FENCED, frozenset([key])))

    # -- the poll thread ------------------------------------------------------------------

    def events(self) -> list[Event]:
        taken = []
        while True:
            try:
                taken.append(self._events.get_nowait())
            except queue.Empty:
                return taken

    def current(self, key: TopicPartitionKey) -> int:
        with self.lock:
            return self._epochs.get(key, 0)

    def owned(self) -> set[TopicPartitionKey]:
        with self.lock:
            return set(self._epochs)

    def _new_epoch(self) -> int:
        epoch = self._next_epoch
        self._next_epoch += 1
        return epoch


class Listener(ConsumerRebalanceListener):
    """Runs on kafka-python's IO thread: bounded waits and state changes only."""

    def __init__(self, ownership: Ownership, revoke_timeout_s: float) -> None:
        self.ownership = ownership
        self.revoke_timeout_s = revoke_timeout_s

    def on_partitions_revoked(self, revoked: Any) -> None:
        self._revoke(revoked, lost=False)

    def on_partitions_lost(self, lost: Any) -> None:
        self._revoke(lost, lost=True)

    def on_partitions_assigned(self, assigned: Any) -> None:
        # Logged by the poll thread, with where each starts (RebalanceLog).
        self.ownership.assigned((tp.topic, tp.partition) for tp in assigned)

    def _revoke(self, partitions: Any, lost: bool) -> None:
        keys = {(tp.topic, tp.partition) for tp in partitions}
        if not keys:
            return
        # Revoked (not lost): give in-flight work on these partitions a bounded
        # time to be published, since the next owner starts past it. What is
        # still in flight after the wait is dropped, never published.
        if not lost and not self.ownership.in_flight.wait_for(keys, self.revoke_timeout_s):
            log.warning(
                "revoke: batches on %s not published within %.1fs; dropping them",
                sorted(keys),
                self.revoke_timeout_s,
            )
        self.ownership.revoked(keys, lost)
        if lost:  # not a rebalance this worker took part in: the group moved on without it
            log.warning("partitions lost: %s", sorted(keys))


def _names(keys: Iterable[TopicPartitionKey], starts: dict[TopicPartitionKey, int]) -> str:
    named = [f"{t}[{p}]" + (f"@{starts[(t, p)]}" if (t, p) in starts else "") for t, p in keys]
    return " ".join(named) if named else "none"


class RebalanceLog:
    """One log line per rebalance this worker takes part in: what it was assigned
    (with where each partition starts reading), revoked and kept, and how long the
    group took, from when this worker learnt of the rebalance (or subscribed, for
    its first) to the assignment. Retried commits and the join's steps log nothing
    more above DEBUG."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since: float | None = clock()  # subscribed: the first join is under way
        self._joined = False

    def watch(self, consumer: KafkaConsumer) -> None:
        """Called before each poll's events are taken: notes when a rebalance began."""
        if self._since is None and internals.rejoining(consumer):
            self._since = self._clock()

    def applied(
        self,
        events: list[Event],
        owned_before: set[TopicPartitionKey],
        started: dict[TopicPartitionKey, int],
    ) -> None:
        if not any(e.change in (Change.ASSIGNED, Change.REVOKED) for e in events):
            return
        assigned = _keys_of(events, Change.ASSIGNED)
        revoked = _keys_of(events, Change.REVOKED) - assigned
        kept = owned_before - revoked - assigned
        took = "" if self._since is None else f" in {self._clock() - self._since:.1f}s"
        what = "joined the group" if not self._joined else "rebalanced"
        log.info(
            "partitions %s%s: assigned %s; revoked %s; kept %s",
            what,
            took,
            _names(sorted(assigned), started),
            _names(sorted(revoked), started),
            _names(sorted(kept), started),
        )
        self._joined = True
        self._since = None

    def closed(self, events: list[Event]) -> None:
        """The revocation that closing the consumer made."""
        revoked = _keys_of(events, Change.REVOKED)
        if revoked:
            log.info("partitions revoked at close: %s", _names(sorted(revoked), {}))


def _keys_of(events: list[Event], change: Change) -> set[TopicPartitionKey]:
    return set().union(*(e.keys for e in events if e.change is change))


@dataclass
class ReadState:
    """The poll thread's view of one owned partition."""

    epoch: int
    next_offset: int  # the next offset to consume; everything below is accounted for
    start_note: str | None = None  # why the partition's first segment starts here
    chain_start: int = -1


@dataclass
class Applied:
    """What a round of rebalance events changed, for the poll loop to act on."""

    changed: set[TopicPartitionKey] = field(default_factory=set)
    started: dict[TopicPartitionKey, int] = field(default_factory=dict)  # key -> start offset
    # Starts past the group's committed offset: the outputs already hold what lies below.
    commit_to: dict[TopicPartitionKey, int] = field(default_factory=dict)
    changes: list[str] = field(default_factory=list)

    def unchanged(self, polled: dict[Any, list[Any]]) -> dict[Any, list[Any]]:
        """What a poll returned, less the records of every changed partition.

        They were fetched from where kafka-python put the partition (the group's
        commit, or its old position), not from where it now starts; the seek
        fetches them again from there. (Kept, records past the start would be
        taken as if everything before them had been read: a damaged last segment
        moved aside leaves the outputs behind the commit, and its range was lost.)
        """
        if not self.changed:
            return polled
        return {
            tp: records
            for tp, records in polled.items()
            if (tp.topic, tp.partition) not in self.changed
        }


class Reader:
    """The poll thread's side: positions, record filtering and pauses.

    Only the poll thread calls it, and only between consumer calls.
    """

    def __init__(
        self,
        consumer: KafkaConsumer,
        ownership: Ownership,
        output: Path,
        kafka: KafkaSettings,
        *,
        on_quarantine: Callable[[], None] = lambda: None,
    ) -> None:
        self.consumer = consumer
        self.ownership = ownership
        self.output = output
        self.kafka = kafka
        self.on_quarantine = on_quarantine
        self.states: dict[TopicPartitionKey, ReadState] = {}
        self.rebalances = RebalanceLog()

    # -- rebalance events -----------------------------------------------------------------

    def apply(self) -> Applied:
        """Applies queued ownership events: forget, seek, re-tag. Call right after poll()."""
        applied = Applied()
        self.rebalances.watch(self.consumer)
        events = self.ownership.events()
        if not events:
            return applied
        owned_before = set(self.states)
        for event in events:
            applied.changed |= event.keys
            applied.changes.append(event.change.value)
        to_start = []
        for key in sorted(applied.changed):
            self.states.pop(key, None)
            epoch = self.ownership.current(key)
            if epoch and self._assigned(key):
                to_start.append((key, epoch))
        if to_start:
            keys = [key for key, _ in to_start]
            committed = self._committed([TopicPartition(*key) for key in keys])
            starts = self._start_offsets(keys, committed)
            for key, epoch in to_start:
                offset, note = starts[key]
                self.consumer.seek(TopicPartition(*key), offset)
                self.states[key] = ReadState(epoch, offset, note, offset)
                applied.started[key] = offset
                if offset > committed.get(TopicPartition(*key), -1):
                    applied.commit_to[key] = offset
        self.rebalances.applied(events, owned_before, applied.started)
        return applied

    def _assigned(self, key: TopicPartitionKey) -> bool:
        return TopicPartition(*key) in self.consumer.assignment()

    def _start_offsets(
        self, keys: list[TopicPartitionKey], committed: dict[TopicPartition, int]
    ) -> dict[TopicPartitionKey, tuple[int, str | None]]:
        """Where each partition starts: past the outputs, else the commit, else its beginning."""
        segments = segments_by_partition(self.output, {t for t, _ in keys})
        starts: dict[TopicPartitionKey, tuple[int, str | None]] = {}
        unwritten = []
        for key in keys:
            high = self._covered_through(key, segments.get(key, []))
            if high is not None:
                starts[key] = (high + 1, None)
            else:
                unwritten.append(TopicPartition(*key))
        if unwritten:
            beginnings = cluster.beginning_offsets(self.consumer, self.kafka, unwritten)
            for tp in unwritten:
                begin = beginnings[tp]
                offset = committed.get(tp)
                if offset is not None and offset > begin:
                    # The worker refused this at start unless the user chose it
                    # (--from-committed): the segment records that choice.
                    starts[(tp.topic, tp.partition)] = (offset, START_FROM_COMMITTED)
                else:
                    starts[(tp.topic, tp.partition)] = (begin, None)
        return starts

    def _covered_through(self, key: TopicPartitionKey, segments: list[Any]) -> int | None:
        remaining = list(segments)
        while True:
            try:
                return covered_through(remaining)
            except DamagedSegment as damaged:
                # We own the partition: its damaged last segment is read again from here.
                quarantine(self.output, damaged.segment, damaged.reason)
                self.on_quarantine()
                remaining.remove(damaged.segment)
            except FileNotFoundError:
                # Moved aside by another worker meanwhile: list again.
                remaining = segments_by_partition(self.output, [key[0]]).get(key, [])

    def _committed(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        def read() -> dict[TopicPartition, int]:
            found = {}
            for tp in partitions:
                offset = self.consumer.committed(tp, timeout_ms=10_000)
                if offset is not None and offset >= 0:
                    found[tp] = offset
            return found

        return cluster.retrying(read, "reading the group's committed offsets", self.kafka)

    # -- records --------------------------------------------------------------------------

    def epoch(self, key: TopicPartitionKey) -> int:
        state = self.states.get(key)
        return 0 if state is None else state.epoch

    def accept(self, key: TopicPartitionKey, offset: int) -> bool:
        """Whether a polled record is new: at or past the next offset of an owned partition."""
        state = self.states.get(key)
        if state is None or offset < state.next_offset:
            return False
        state.next_offset = offset + 1
        return True

    def accept_run(self, key: TopicPartitionKey, records: list[S]) -> list[S]:
        """The new records of one partition's polled run (records with `.offset`, in
        offset order, as a fetch returns them): `accept` of each, for the run at once
        where its first record is new (then all are)."""
        state = self.states.get(key)
        if state is None or not records:
            return []
        if records[0].offset >= state.next_offset:
            state.next_offset = records[-1].offset + 1
            return records
        return [r for r in records if self.accept(key, r.offset)]

    def skipped_to(self, key: TopicPartitionKey) -> int | None:
        """A new next offset when the consumer moved past offsets that hold no record
        (transaction markers, aborted or compacted records); None otherwise."""
        state = self.states.get(key)
        if state is None:
            return None
        tp = TopicPartition(*key)
        try:
            position = self.consumer.position(tp, timeout_ms=0)
        except kerrors.KafkaError:  # unassigned meanwhile, no position yet: nothing skipped
            return None
        if position is None or position <= state.next_offset:
            return None
        state.next_offset = position
        return position

    def restart_at(self, key: TopicPartitionKey, offset: int) -> None:
        """Moves an owned partition to `offset` (retention removed what came before)."""
        state = self.states.get(key)
        if state is not None:
            self.consumer.seek(TopicPartition(*key), offset)
            state.next_offset = offset

    def take_start_note(self, key: TopicPartitionKey, first: int) -> str | None:
        """The start note for a segment beginning at `first`, once."""
        state = self.states.get(key)
        if state is None or state.start_note is None or first != state.chain_start:
            return None
        note, state.start_note = state.start_note, None
        return note

    # -- backpressure ---------------------------------------------------------------------

    def set_paused(self, paused: bool) -> int:
        """Pauses or resumes every assigned partition; returns how many are paused.

        Reconciled against the consumer's own paused set each time: kafka-python
        keeps the pause flag of a partition that survives a rebalance, so a
        remembered set of our own would drift from it.
        """
        return self.pause_only(set(self.consumer.assignment()) if paused else set())

    def pause_only(self, partitions: set[TopicPartition]) -> int:
        """Pauses exactly these of the assigned partitions and resumes the others;
        returns how many are paused. Reconciled like `set_paused` (consumers.tiers
        pauses one tier and not the other)."""
        assigned = set(self.consumer.assignment())
        actual = set(self.consumer.paused()) & assigned
        wanted = partitions & assigned
        if wanted - actual:
            self.consumer.pause(*(wanted - actual))
        if actual - wanted:
            self.consumer.resume(*(actual - wanted))
        return len(wanted)


def caught_up_with(
    consumer: KafkaConsumer, empty_full_poll: bool, only: set[TopicPartition] | None = None
) -> bool:
    """Whether every partition read here (`only`: those) has nothing more to fetch
    right now: a full-length poll came back empty, or each partition's position has
    reached its high watermark (known once a fetch for it returned). Paused
    partitions may hold more, so nothing is caught up while any is."""
    if consumer.paused() if only is None else consumer.paused() & only:
        return False  # with `only` (one tier's partitions), those alone count
    if empty_full_poll:
        return True
    assignment = consumer.assignment() if only is None else only
    if not assignment:
        return False
    for tp in assignment:
        highwater = consumer.highwater(tp)
        if highwater is None:
            return False
        try:
            # Known positions are answered locally; an unknown one is not waited for.
            position = consumer.position(tp, timeout_ms=0)
        except kerrors.KafkaError:
            return False
        if position is None or position < highwater:
            return False
    return True
