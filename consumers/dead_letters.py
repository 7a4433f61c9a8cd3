"""Dead letters exactly once: the protocol, in one place.

A bad record's offset is committed only once its dead letter is acknowledged, so
the dead letter is sent before the batch's segment is published. A worker that
sent a batch's dead letters and then died, stalled or lost its partitions before
the publish leaves them in the topic while the next owner of the partition reads
the same records again. Kafka has no conditional append to make the second send
a no-op, so the next owner looks first:

- *One dead-letter partition per source partition* (`dead_letter_partition`):
  what earlier owners sent for a partition is in one place, in source order.
- *A mark in every segment* (`DeadLetterMark`, `segment.dead_letters_from`): a
  dead-letter offset at or below every dead letter of the partition past the
  segment's last offset. A new owner (a new epoch: an assignment, or a fence
  after a lost publish race) reads the dead-letter partition from the mark of the
  segment it starts after, once, before its first publish (`prepare`), and never
  sends what it found. The mark a segment records is the lowest dead letter an
  earlier owner sent past it, or, when there is none, a dead-letter end offset
  this worker has seen, which only grows: so marks advance and reads stay short.
- *Only an owner the group still hears sends* (`send`): the write stage checks
  ownership and the group's lease under the revocation lock, then sends and
  publishes. A revoked worker has finished sending before the revocation returns
  (so before the next owner is assigned); a stalled one stops sending once the
  group has not heard from it for `lease` of its session timeout, well before the
  group gives its partitions away.

What remains, and is said in docs/exactly-once.md: a worker frozen in the few
microseconds between that check and its producer's write to the socket, for
longer than the rest of its session, can still double a dead letter (only Kafka
transactions fence a producer, and their aborted records are visible to every
read_uncommitted reader).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import groupby
from operator import attrgetter
from typing import Protocol

from pipeline.core.layout import Output, TopicPartitionKey, segments_by_partition
from pipeline.core.records import BadRecord
from pipeline.kafka.dead_letter import Scanned, dead_letter_partition
from sinks.segments import DeadLetterMark, segment_before

log = logging.getLogger(__name__)

# How often the dead-letter end offsets are read again to advance the marks of
# partitions that send nothing (a read of one offset per partition, off the hot path).
REFRESH_S = 10.0
# A read of the dead-letter topic longer than this many records is worth a line.
_LONG_READ = 10_000

_source_key = attrgetter("source.topic", "source.partition")


class Topic(Protocol):
    """What the ledger needs of the dead-letter topic (pipeline.kafka.dead_letter)."""

    topic: str

    def partitions(self) -> int: ...

    def send(self, records: list[BadRecord], partitions: int) -> dict[int, int]: ...

    def end_offsets(self, partitions: Iterable[int]) -> dict[int, int]: ...

    def scan(
        self, partition: int, start: int | None, sources: Iterable[TopicPartitionKey]
    ) -> Scanned: ...


@dataclass
class _Epoch:
    """One ownership of one partition (an assignment, or a fence)."""

    epoch: int
    start: int  # the first offset this ownership reads
    scanned: bool = False
    # Dead letters earlier owners sent at or past `start`:
    # source offset -> (dead-letter partition, offset).
    found: dict[int, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """What the write stage does with one partition of a batch."""

    send: list[BadRecord]  # the bad records not dead-lettered yet
    mark: DeadLetterMark  # recorded in the partition's segment


class DeadLetterLedger:
    """The worker's side of the protocol; the poll thread tells it of new ownerships,
    the write thread prepares and sends."""

    def __init__(self, topic: Topic, output: Output, refresh_s: float = REFRESH_S) -> None:
        self.topic = topic
        self.output = output
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._epochs: dict[TopicPartitionKey, _Epoch] = {}
        self._count: int | None = None  # partitions of the dead-letter topic
        # Per dead-letter partition, an offset at or below its end now (only grows).
        self._floor: dict[int, int] = {}
        self._refreshed = float("-inf")
        self.skipped = 0  # bad records found already dead-lettered, not sent again

    # -- the poll thread --------------------------------------------------------------------

    def started(
        self, starts: dict[TopicPartitionKey, int], epoch: Callable[[TopicPartitionKey], int]
    ) -> None:
        """New ownerships: key -> the first offset it reads; `epoch(key)`: its epoch."""
        with self._lock:
            for key, offset in starts.items():
                self._epochs[key] = _Epoch(epoch(key), offset)

    # -- the write thread -------------------------------------------------------------------

    def unread(self) -> dict[TopicPartitionKey, int]:
        """Ownerships whose earlier owners' dead letters are not read yet: key -> epoch."""
        with self._lock:
            return {key: state.epoch for key, state in self._epochs.items() if not state.scanned}

    def read_ahead(self, keys: list[TopicPartitionKey]) -> None:
        """Reads now what earlier owners of these new ownerships sent (`unread`, still
        owned), so that their first batch's write does not wait for the read (a
        consumer's start and a fetch)."""
        with self._lock:
            keys = [key for key in keys if key in self._epochs and not self._epochs[key].scanned]
        self._scan(keys)

    def prepare(
        self,
        bad: list[BadRecord],
        ranges: dict[TopicPartitionKey, tuple[int, int, int]],
    ) -> dict[TopicPartitionKey, Plan]:
        """For each partition of a batch (key -> (epoch, first, last)), the dead letters
        to send and the mark its segment records. Reads the dead-letter topic for
        ownerships that have not looked yet; partitions of an ownership the ledger does
        not know (revoked meanwhile) are left out: they are not published."""
        states = self._states(ranges)
        self._scan([key for key, state in states.items() if not state.scanned])
        self._refresh()
        by_key = _group(bad)
        plans = {}
        for key, state in states.items():
            _, _, last = ranges[key]
            fresh = [b for b in by_key.get(key, []) if b.source.offset not in state.found]
            self.skipped += len(by_key.get(key, [])) - len(fresh)
            plans[key] = Plan(fresh, self._mark(key, state, last))
        return plans

    def send(self, plans: dict[TopicPartitionKey, Plan], keys: Iterable[TopicPartitionKey]) -> int:
        """Sends the planned dead letters of these partitions (owned, and the group hears
        this worker: the caller checked, under the revocation lock); how many were sent."""
        records = [bad for key in keys for bad in plans[key].send]
        if not records:
            return 0
        highest = self.topic.send(records, self._partitions())
        with self._lock:
            for partition, offset in highest.items():
                self._raise_floor(partition, offset + 1)
        return len(records)

    def published(self, key: TopicPartitionKey, epoch: int, last: int) -> None:
        """Forgets what earlier owners sent up to `last`: it is behind the outputs now."""
        with self._lock:
            state = self._epochs.get(key)
            if state is not None and state.epoch == epoch:
                state.found = {o: at for o, at in state.found.items() if o > last}

    # -- inside -----------------------------------------------------------------------------

    def _states(
        self, ranges: dict[TopicPartitionKey, tuple[int, int, int]]
    ) -> dict[TopicPartitionKey, _Epoch]:
        with self._lock:
            states = {}
            for key, (epoch, _, _) in ranges.items():
                state = self._epochs.get(key)
                if state is not None and state.epoch == epoch:
                    states[key] = state
            return states

    def _partitions(self) -> int:
        if self._count is None:
            self._count = self.topic.partitions()
        return self._count

    def _scan(self, keys: list[TopicPartitionKey]) -> None:
        """Reads, once per ownership, what earlier owners of these partitions dead-lettered:
        each dead-letter partition once, from the lowest mark among them."""
        if not keys:
            return
        with self._lock:  # before the starts are read: a newer ownership's are not these
            epochs = {key: self._epochs[key].epoch for key in keys}
        self._count = None  # the topic may have gained partitions since the last look
        count = self._partitions()
        starts = self._starts(keys, count)
        wanted: dict[int, list[TopicPartitionKey]] = defaultdict(list)
        froms: dict[int, list[int | None]] = defaultdict(list)
        for key, reads in starts.items():
            for partition, offset in reads:
                wanted[partition].append(key)
                froms[partition].append(offset)
        begin = {p: _lowest(f) for p, f in froms.items()}
        started = time.perf_counter()
        results = {p: self.topic.scan(p, begin[p], set(wanted[p])) for p in sorted(wanted)}
        self._record(epochs, results)
        read = sum(r.read for r in results.values())
        if read >= _LONG_READ:
            log.info(
                "dead letters: read %d record(s) of %s in %.1fs to find what earlier owners "
                "of %d partition(s) sent",
                read,
                self.topic.topic,
                time.perf_counter() - started,
                len(keys),
            )

    def _starts(
        self, keys: list[TopicPartitionKey], count: int
    ) -> dict[TopicPartitionKey, list[tuple[int, int | None]]]:
        """Per partition, the dead-letter partitions to read and from where (None: all)."""
        by_topic = segments_by_partition(self.output, {t for t, _ in keys})
        with self._lock:
            first = {key: self._epochs[key].start for key in keys}
        starts = {}
        for key in keys:
            home = dead_letter_partition(key[1], count)
            before = segment_before(by_topic.get(key, []), first[key])
            mark = None if before is None else before.dead_letters
            if mark is None or mark.topic != self.topic.topic:
                starts[key] = [(home, None)]  # no mark (older writers, a new topic): all
            elif mark.partition != home:  # the topic gained partitions since
                starts[key] = [(home, None), (mark.partition, mark.offset)]
            else:
                starts[key] = [(home, mark.offset)]
        return starts

    def _record(self, epochs: dict[TopicPartitionKey, int], results: dict[int, Scanned]) -> None:
        keys = list(epochs)
        with self._lock:
            for partition, scanned in results.items():
                self._raise_floor(partition, scanned.end)
            for key in keys:
                state = self._epochs.get(key)
                if state is None or state.epoch != epochs[key]:
                    continue  # owned again since the read began: that ownership reads anew
                for partition, scanned in results.items():
                    for offset, at in scanned.found.get(key, {}).items():
                        if offset >= state.start:
                            state.found.setdefault(offset, (partition, at))
                state.scanned = True
            found = sum(len(self._epochs[k].found) for k in keys if k in self._epochs)
        if found:
            log.info(
                "dead letters: %d bad record(s) of %s were dead-lettered by an earlier owner "
                "and will not be sent again",
                found,
                ", ".join(f"{t}[{p}]" for t, p in sorted(keys)),
            )

    def _refresh(self) -> None:
        """Advances the floors to the dead-letter topic's end, now and then."""
        if time.monotonic() - self._refreshed < self.refresh_s or not self._floor:
            return
        self._refreshed = time.monotonic()
        ends = self.topic.end_offsets(list(self._floor))
        with self._lock:
            for partition, end in ends.items():
                self._raise_floor(partition, end)

    def _raise_floor(self, partition: int, offset: int) -> None:
        self._floor[partition] = max(self._floor.get(partition, 0), offset)

    def _mark(self, key: TopicPartitionKey, state: _Epoch, last: int) -> DeadLetterMark:
        """A dead-letter offset at or below every dead letter of `key` past `last`."""
        home = dead_letter_partition(key[1], self._partitions())
        with self._lock:
            beyond = [at for offset, at in state.found.items() if offset > last]
            floor = self._floor.get(home, 0)
        # Earlier owners' dead letters past `last` pin the mark; none: this worker alone
        # sends past `last`, and only after this segment is published.
        elsewhere = [at for at in beyond if at[0] != home]
        if elsewhere:  # sent before the topic gained partitions: the next owner reads
            return DeadLetterMark(self.topic.topic, *min(elsewhere))  # home whole, and these
        offsets = [offset for _, offset in beyond]
        return DeadLetterMark(self.topic.topic, home, min(offsets) if offsets else floor)


def _lowest(offsets: list[int | None]) -> int | None:
    """The lowest start among several; None (from the beginning) wins."""
    return None if None in offsets else min(o for o in offsets if o is not None)


def _group(bad: list[BadRecord]) -> dict[TopicPartitionKey, list[BadRecord]]:
    """A batch's bad records by partition (runs of one partition's records, in order)."""
    by_key: dict[TopicPartitionKey, list[BadRecord]] = defaultdict(list)
    for key, run in groupby(bad, _source_key):
        by_key[key].extend(run)
    return by_key
