"""Batcher: micro-batches close on record count, token budget or age; they record
the offsets (bad records included) and assignment epochs of their partitions."""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest

from consumers.batcher import Batcher, CloseReason, MicroBatch
from pipeline.core.records import BadRecord, GoodRecord, SourceRecord

Item = tuple[GoodRecord | BadRecord, list[int] | None]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def src(offset: int, partition: int = 0, topic: str = "t") -> SourceRecord:
    return SourceRecord(topic, partition, offset, 0, None, b"{}")


def good(offset: int, n_tokens: int = 3, partition: int = 0, topic: str = "t") -> Item:
    record = GoodRecord(src(offset, partition, topic), f"text {offset}", None, None)
    return record, list(range(100 + offset, 100 + offset + n_tokens))


def bad(offset: int, partition: int = 0, topic: str = "t") -> Item:
    return BadRecord(src(offset, partition, topic), "decode", "InvalidJson", "x"), None


def epoch_zero(_key: tuple[str, int]) -> int:
    return 0


def make(
    max_records: int = 100, max_tokens: int = 1000, max_wait_s: float = 1.0
) -> tuple[Batcher, FakeClock]:
    clock = FakeClock()
    return Batcher(max_records, max_tokens, max_wait_s, clock=clock), clock


def offsets(batch: MicroBatch) -> list[int]:
    return sorted(r.source.offset for r in [*batch.good, *batch.bad])


def add_all(batcher: Batcher, items: Iterable[Item]) -> list[MicroBatch]:
    return batcher.add(items, epoch_zero)


# ------------------------------------------------------------------ closing rules


def sized(offset: int, size: int, partition: int = 0) -> Item:
    source = SourceRecord("t", partition, offset, 0, None, b"x" * size)
    return GoodRecord(source, "x", None, None), [1, 2]


def test_closes_before_the_value_bytes_would_pass_the_bound() -> None:
    clock = FakeClock()
    batcher = Batcher(100, 10_000, 1.0, clock=clock, max_bytes=1000)
    closed = add_all(batcher, [sized(0, 400), sized(1, 400), sized(2, 400), sized(3, 100)])
    assert [offsets(b) for b in closed] == [[0, 1]]
    assert closed[0].closed_by is CloseReason.BYTES
    assert closed[0].value_bytes == 800
    # a single value over the bound still travels, alone
    closed = add_all(batcher, [sized(4, 5000), sized(5, 10)])
    assert [offsets(b) for b in closed] == [[2, 3], [4]]
    assert batcher.pending == 1


def test_dropping_partitions_recounts_the_bytes() -> None:
    clock = FakeClock()
    batcher = Batcher(100, 10_000, 1.0, clock=clock, max_bytes=10_000)
    add_all(batcher, [sized(0, 300, partition=0), sized(0, 500, partition=1)])
    batcher.drop({("t", 1)})
    batch = batcher.flush(CloseReason.SHUTDOWN)
    assert batch is not None and batch.value_bytes == 300


def test_closes_on_record_count() -> None:
    batcher, _ = make(max_records=3)
    closed = add_all(batcher, [good(i) for i in range(7)])
    assert [offsets(b) for b in closed] == [[0, 1, 2], [3, 4, 5]]
    assert {b.closed_by for b in closed} == {CloseReason.RECORDS}
    assert batcher.pending == 1
    rest = batcher.flush(CloseReason.CAUGHT_UP)
    assert rest is not None and offsets(rest) == [6]
    assert rest.closed_by is CloseReason.CAUGHT_UP
    assert batcher.flush(CloseReason.SHUTDOWN) is None


def test_bad_records_count_toward_record_count() -> None:
    batcher, _ = make(max_records=3)
    closed = add_all(batcher, [good(0), bad(1), bad(2), bad(3)])
    assert len(closed) == 1
    assert len(closed[0]) == 3
    assert [r.source.offset for r in closed[0].good] == [0]
    assert [r.source.offset for r in closed[0].bad] == [1, 2]
    assert batcher.pending == 1


def test_closes_before_token_budget_would_be_exceeded() -> None:
    batcher, _ = make(max_tokens=10)
    closed = add_all(batcher, [good(0, 4), good(1, 4), good(2, 4)])
    assert len(closed) == 1
    assert offsets(closed[0]) == [0, 1]
    assert closed[0].tokens == 8
    assert closed[0].closed_by is CloseReason.TOKENS
    assert batcher.pending == 1


def test_closes_when_token_budget_is_reached_exactly() -> None:
    batcher, _ = make(max_tokens=10)
    closed = add_all(batcher, [good(0, 6), good(1, 4)])
    assert len(closed) == 1 and closed[0].tokens == 10
    assert batcher.pending == 0


def test_single_record_over_budget_gets_a_batch_of_its_own() -> None:
    batcher, _ = make(max_tokens=10)
    closed = add_all(batcher, [good(0, 2), good(1, 25), good(2, 2)])
    assert [offsets(b) for b in closed] == [[0], [1]]
    assert closed[1].tokens == 25
    assert batcher.pending == 1


def test_token_budget_never_exceeded_except_by_a_single_record() -> None:
    rng = random.Random(7)
    batcher, _ = make(max_records=50, max_tokens=64)
    items: list[Item] = []
    for offset in range(2000):
        if rng.random() < 0.15:
            items.append(bad(offset))
        else:
            items.append(good(offset, rng.choice([1, 5, 17, 40, 63, 64, 65, 90])))
    closed = add_all(batcher, items)
    rest = batcher.flush(CloseReason.SHUTDOWN)
    batches = closed + ([rest] if rest else [])
    for batch in batches:
        assert batch.tokens == sum(len(ids) for ids in batch.token_ids)
        assert batch.tokens <= 64 or len(batch.good) == 1
        assert len(batch) <= 50
    # nothing lost, nothing duplicated, order of arrival kept across batches
    seen = [r.source.offset for b in batches for r in sorted([*b.good, *b.bad], key=_offset)]
    assert seen == list(range(2000))


def _offset(record: GoodRecord | BadRecord) -> int:
    return record.source.offset


def test_closes_on_age_of_first_record() -> None:
    batcher, clock = make(max_wait_s=0.5)
    assert batcher.due() is None
    assert batcher.seconds_until_due() is None
    add_all(batcher, [good(0)])
    clock.now += 0.3
    add_all(batcher, [good(1)])  # a later record does not restart the clock
    assert batcher.seconds_until_due() == pytest.approx(0.2)
    assert batcher.due() is None
    clock.now += 0.2
    assert batcher.seconds_until_due() == 0.0
    batch = batcher.due()
    assert batch is not None and offsets(batch) == [0, 1]
    assert batch.opened_at == 1000.0
    assert batch.closed_at == pytest.approx(1000.5)
    assert batch.closed_by is CloseReason.AGE
    assert batcher.pending == 0
    assert batcher.due() is None


def test_new_batch_after_close_starts_a_fresh_age() -> None:
    batcher, clock = make(max_records=1, max_wait_s=0.5)
    add_all(batcher, [good(0)])  # closes at once on count
    clock.now += 10
    add_all(batcher, [])
    assert batcher.due() is None
    batcher2, clock2 = make(max_records=2, max_wait_s=0.5)
    add_all(batcher2, [good(0), good(1)])
    clock2.now += 10
    add_all(batcher2, [good(2)])
    assert batcher2.due() is None  # opened just now, not 10 s ago
    assert batcher2.seconds_until_due() == pytest.approx(0.5)


def test_batch_numbers_increase() -> None:
    batcher, _ = make(max_records=1)
    closed = add_all(batcher, [good(0), good(1), good(2)])
    numbers = [b.number for b in closed]
    assert numbers == sorted(numbers) and len(set(numbers)) == 3


def test_tokenized_matches_good_records() -> None:
    batcher, _ = make()
    add_all(batcher, [good(0, 3), bad(1), good(2, 5)])
    batch = batcher.flush(CloseReason.SHUTDOWN)
    assert batch is not None
    tokens = batch.tokenized()
    assert len(tokens) == 2
    assert tokens.lengths.tolist() == [3, 5]
    assert tokens.ids == batch.token_ids
    assert tokens.total_tokens == batch.tokens == 8


# ------------------------------------------------------------------ ranges and epochs


def test_ranges_cover_first_and_last_offset_per_partition_including_bad() -> None:
    batcher, _ = make()
    add_all(
        batcher,
        [bad(4, 0), good(5, 2, 0), good(20, 2, 1), bad(6, 0), bad(21, 1), good(3, 1, 2, "u")],
    )
    batch = batcher.flush(CloseReason.SHUTDOWN)
    assert batch is not None
    assert batch.ranges == {("t", 0): [4, 6], ("t", 1): [20, 21], ("u", 2): [3, 3]}


def test_partition_with_only_bad_records_has_a_range() -> None:
    batcher, _ = make()
    add_all(batcher, [bad(8, 1), bad(9, 1)])
    batch = batcher.flush(CloseReason.SHUTDOWN)
    assert batch is not None
    assert batch.ranges == {("t", 1): [8, 9]}
    assert batch.good == [] and batch.tokens == 0


def test_epochs_captured_per_partition_via_epoch_of() -> None:
    batcher, _ = make(max_records=4)
    epochs = {("t", 0): 3, ("t", 1): 8}
    calls: list[tuple[str, int]] = []

    def epoch_of(key: tuple[str, int]) -> int:
        calls.append(key)
        return epochs[key]

    closed = batcher.add([good(0, 1, 0), bad(0, 1), good(1, 1, 0), good(1, 1, 1)], epoch_of)
    assert len(closed) == 1
    assert closed[0].epochs == {("t", 0): 3, ("t", 1): 8}
    assert set(calls) == {("t", 0), ("t", 1)}
    # after a reassignment the next batch carries the new epoch
    epochs[("t", 0)] = 4
    batcher.add([good(2, 1, 0)], epoch_of)
    batch = batcher.flush(CloseReason.SHUTDOWN)
    assert batch is not None and batch.epochs == {("t", 0): 4}


# ------------------------------------------------------------------ drop / without


def test_drop_forgets_open_records_of_revoked_partitions() -> None:
    batcher, _ = make()
    add_all(batcher, [good(0, 2, 0), good(0, 3, 1), bad(1, 1), good(1, 4, 0), bad(2, 0)])
    batcher.drop({("t", 1)})
    assert batcher.pending == 3
    batch = batcher.flush(CloseReason.SHUTDOWN)
    assert batch is not None
    assert {(r.source.partition, r.source.offset) for r in batch.good} == {(0, 0), (0, 1)}
    assert [(r.source.partition, r.source.offset) for r in batch.bad] == [(0, 2)]
    assert batch.ranges == {("t", 0): [0, 2]}
    assert set(batch.epochs) == {("t", 0)}
    assert batch.tokens == 6
    assert [len(ids) for ids in batch.token_ids] == [2, 4]


def test_drop_of_every_open_partition_leaves_nothing_open() -> None:
    batcher, clock = make(max_wait_s=0.1)
    add_all(batcher, [good(0, 2, 0), bad(1, 0)])
    batcher.drop({("t", 0), ("t", 9)})
    assert batcher.pending == 0
    clock.now += 1
    assert batcher.due() is None
    assert batcher.flush(CloseReason.SHUTDOWN) is None


def test_drop_of_unrelated_or_no_partitions_changes_nothing() -> None:
    batcher, _ = make()
    add_all(batcher, [good(0, 2, 0), good(1, 2, 0)])
    batcher.drop(set())
    batcher.drop({("other", 0)})
    batch = batcher.flush(CloseReason.SHUTDOWN)
    assert batch is not None and offsets(batch) == [0, 1] and batch.tokens == 4


def test_without_is_a_copy_and_keeps_token_ids_aligned() -> None:
    batcher, _ = make()
    add_all(batcher, [good(0, 1, 0), good(0, 2, 1), good(1, 3, 0), bad(1, 1), good(2, 4, 1)])
    batch = batcher.flush(CloseReason.SHUTDOWN)
    assert batch is not None
    kept = batch.without({("t", 0)})
    for record, ids in zip(kept.good, kept.token_ids, strict=True):
        assert ids[0] == 100 + record.source.offset  # the ids made for that record
    assert [(r.source.partition, r.source.offset) for r in kept.good] == [(1, 0), (1, 2)]
    assert [len(ids) for ids in kept.token_ids] == [2, 4]
    assert kept.tokens == 6
    assert len(kept.bad) == 1
    assert kept.ranges == {("t", 1): [0, 2]}
    assert kept.number == batch.number
    assert (kept.opened_at, kept.closed_at) == (batch.opened_at, batch.closed_at)
    # the original batch is untouched
    assert len(batch) == 5 and batch.tokens == 10
    assert set(batch.ranges) == {("t", 0), ("t", 1)}


# ------------------------------------------------------------------ ranges tile offsets


def test_consecutive_ranges_tile_a_partition_from_its_start_over_gaps() -> None:
    # Offsets 10, 11 and 15 hold no record (transaction markers, aborted records):
    # the ranges still tile, so the segments say how far the partition was read.
    batcher, _ = make(max_records=2)
    batcher.start(("t", 0), 10)
    closed = add_all(batcher, [good(12, 1), good(13, 1), good(14, 1), good(16, 1)])
    assert [b.ranges for b in closed] == [{("t", 0): [10, 13]}, {("t", 0): [14, 16]}]


def test_advance_covers_offsets_passed_without_records() -> None:
    batcher, _ = make()
    batcher.start(("t", 0), 0)
    add_all(batcher, [good(0, 1), good(1, 1)])
    batcher.advance(("t", 0), 5, epoch=0)  # a commit marker at 2, aborted records 3-4
    batch = batcher.flush(CloseReason.CAUGHT_UP)
    assert batch is not None and batch.ranges == {("t", 0): [0, 4]}
    # Nothing open, only a marker passed: a batch with a range and no records.
    batcher.advance(("t", 0), 6, epoch=7)
    assert batcher.is_open and batcher.pending == 0
    batch = batcher.flush(CloseReason.CAUGHT_UP)
    assert batch is not None and len(batch) == 0
    assert batch.ranges == {("t", 0): [5, 5]} and batch.epochs == {("t", 0): 7}
    # An advance to where the partition already is opens nothing.
    batcher.advance(("t", 0), 6, epoch=7)
    assert not batcher.is_open


def test_advance_without_a_start_does_nothing() -> None:
    batcher, _ = make()
    batcher.advance(("t", 3), 100, epoch=1)
    assert not batcher.is_open


def test_drop_forgets_where_the_partition_was_and_start_sets_it_again() -> None:
    batcher, _ = make()
    batcher.start(("t", 0), 0)
    add_all(batcher, [good(0, 1), good(1, 1)])
    batcher.drop({("t", 0)})
    assert not batcher.is_open
    batcher.start(("t", 0), 40)  # the outputs ended at 39 meanwhile
    add_all(batcher, [good(42, 1)])
    batch = batcher.flush(CloseReason.SHUTDOWN)
    assert batch is not None and batch.ranges == {("t", 0): [40, 42]}


# ------------------------------------------------------------------ against a model


class OneAtATime:
    """The closing rules and ranges, one record at a time: the model the batcher's
    run-at-a-time loop must agree with."""

    def __init__(self, max_records: int, max_tokens: int, max_bytes: int | None) -> None:
        self.max_records, self.max_tokens, self.max_bytes = max_records, max_tokens, max_bytes
        self.open: dict | None = None
        self.next: dict[tuple[str, int], int] = {}

    def add(self, items: list[Item], epoch_of) -> list[dict]:
        closed = []
        for record, ids in items:
            n_tokens, size = len(ids or []), len(record.source.value or b"")
            batch = self.open
            if batch is not None and batch["count"]:
                if batch["good"] and batch["tokens"] + n_tokens > self.max_tokens:
                    closed.append(self.close(CloseReason.TOKENS))
                elif self.max_bytes is not None and batch["bytes"] + size > self.max_bytes:
                    closed.append(self.close(CloseReason.BYTES))
            if self.open is None:
                self.open = {"good": [], "bad": [], "count": 0, "tokens": 0, "bytes": 0}
                self.open.update(ranges={}, epochs={})
            batch = self.open
            key = (record.source.topic, record.source.partition)
            offset = record.source.offset
            if key not in batch["ranges"]:
                batch["ranges"][key] = [self.next.get(key, offset), offset]
                batch["epochs"][key] = epoch_of(key)
            batch["ranges"][key][1] = max(batch["ranges"][key][1], offset)
            self.next[key] = offset + 1
            batch["good" if ids is not None else "bad"].append((key, offset, ids))
            batch["count"] += 1
            batch["tokens"] += n_tokens
            batch["bytes"] += size
            if batch["count"] >= self.max_records:
                closed.append(self.close(CloseReason.RECORDS))
            elif batch["tokens"] >= self.max_tokens:
                closed.append(self.close(CloseReason.TOKENS))
            elif self.max_bytes is not None and batch["bytes"] >= self.max_bytes:
                closed.append(self.close(CloseReason.BYTES))
        return closed

    def close(self, reason: CloseReason) -> dict:
        batch, self.open = self.open, None
        assert batch is not None
        return {**batch, "closed_by": reason}


def seen(batch: MicroBatch | None, reason: CloseReason | None = None) -> dict | None:
    if batch is None:
        return None
    entries = [
        ((r.source.topic, r.source.partition), r.source.offset, ids)
        for r, ids in zip(batch.good, batch.token_ids, strict=True)
    ]
    return {
        "good": entries,
        "bad": [((b.source.topic, b.source.partition), b.source.offset, None) for b in batch.bad],
        "count": len(batch),
        "tokens": batch.tokens,
        "bytes": batch.value_bytes,
        "ranges": batch.ranges,
        "epochs": batch.epochs,
        **({"closed_by": reason} if reason else {}),
    }


@pytest.mark.parametrize("bad_share", [0.2, 0.02, 0.0])
@pytest.mark.parametrize("seed", range(40))
def test_batches_are_those_of_the_one_record_at_a_time_rules(seed: int, bad_share: float) -> None:
    rng = random.Random(seed)
    max_records, max_tokens = rng.choice([1, 2, 7, 50]), rng.choice([1, 10, 60, 10_000])
    max_bytes = rng.choice([None, 1, 100, 700])
    batcher = Batcher(max_records, max_tokens, 1.0, clock=FakeClock(), max_bytes=max_bytes)
    model = OneAtATime(max_records, max_tokens, max_bytes)
    epochs = {(topic, p): rng.randrange(5) for topic in "ab" for p in range(3)}
    positions = dict.fromkeys(epochs, 0)
    for _ in range(30):
        polled: list[Item] = []
        for key in rng.sample(sorted(epochs), rng.randint(1, 4)):  # a poll: runs by partition
            for _ in range(rng.choice([0, 1, 3, 20, 150])):
                offset = positions[key] = positions[key] + rng.choice([1, 1, 1, 4])
                source = SourceRecord(key[0], key[1], offset, 0, None, b"v" * rng.randrange(300))
                if rng.random() < bad_share:
                    polled.append((BadRecord(source, "decode", "InvalidJson", "x"), None))
                else:
                    ids = list(range(rng.choice([0, 1, 5, 30, 80])))
                    polled.append((GoodRecord(source, "t", None, None), ids))
        got = [seen(b, b.closed_by) for b in batcher.add(polled, epochs.__getitem__)]
        assert got == model.add(polled, epochs.__getitem__)
        assert seen(batcher._open) == model.open
