"""Priority tiers (consumers/tiers.py) without a broker: the pause decision and its
hysteresis, backfill batch sizing, the embed queue's order, batches that never mix
tiers, pauses reconciled per tier, the tier in commits and in `pipeline status`.
The real thing runs in test_priority_tiers.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from kafka import TopicPartition
from kafka.future import Future

from consumers.batcher import Batcher, CloseReason, MicroBatch
from consumers.committer import OffsetCommitter
from consumers.partitions import Ownership, Reader
from consumers.tiers import (
    BACKFILL,
    INITIAL_BACKFILL_RECORDS,
    MIN_BACKFILL_RECORDS,
    NEARLINE,
    EmbedRate,
    TieredBatcher,
    TierQueue,
    Tiers,
    batch_is_backfill,
    commit_metadata,
    fetch_lag,
    tier_from_metadata,
)
from pipeline import cli
from pipeline.core.config import KafkaSettings, WorkerConfig
from pipeline.core.errors import ConfigError
from pipeline.core.records import GoodRecord, SourceRecord
from pipeline.kafka.internals import unpark_resumed
from pipeline.status import LAGGING, MISMATCH, OK, STALLED, render_table
from pipeline.status.tiers import apply_tiers
from tests.test_partitions import FakeConsumer

LIVE, CORPUS = "live", "corpus"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_tiers(clock: Clock | None = None, **kwargs: Any) -> Tiers:
    return Tiers([CORPUS], 1.0, 4096, clock=clock or Clock(), **kwargs)


# -- the pause decision --------------------------------------------------------------------


def test_backfill_waits_at_any_nearline_lag_and_resumes_after_a_quiet_second() -> None:
    clock = Clock()
    tiers = make_tiers(clock)
    assert tiers.observe(0) is False
    assert tiers.observe(5) is True and tiers.pauses == 1
    clock.now += 0.5
    assert tiers.observe(0) is True  # caught up (first seen at zero now) ...
    clock.now += 0.6
    assert tiers.observe(0) is True  # ... but not for long enough
    clock.now += 0.5
    assert tiers.observe(0) is False  # 1.1 s at zero: resume
    assert tiers.pauses == 1


def test_lag_coming_back_restarts_the_quiet_period() -> None:
    clock = Clock()
    tiers = make_tiers(clock)
    tiers.observe(3)
    clock.now += 0.9
    tiers.observe(0)
    clock.now += 0.5
    assert tiers.observe(1) is True  # lag again: still waiting, same pause
    clock.now += 0.9
    assert tiers.observe(0) is True
    clock.now += 0.9
    assert tiers.observe(0) is True  # 0.9 s since the lag went, not 1.0
    clock.now += 0.2
    assert tiers.observe(0) is False
    assert tiers.pauses == 1


def test_threshold_above_one_keeps_a_small_lag_from_pausing() -> None:
    clock = Clock()
    tiers = make_tiers(clock, pause_at=10)
    assert tiers.observe(9) is False
    assert tiers.observe(10) is True
    clock.now += 5
    assert tiers.observe(4) is True  # below the threshold is not caught up
    assert tiers.observe(0) is True
    clock.now += 1
    assert tiers.observe(0) is False


def test_no_nearline_lag_never_pauses_backfill() -> None:
    clock = Clock()
    tiers = make_tiers(clock)
    for _ in range(100):
        clock.now += 0.05
        assert tiers.observe(0) is False
    assert tiers.pauses == 0


# -- backfill batch size -------------------------------------------------------------------


def test_backfill_batches_follow_the_measured_embed_rate() -> None:
    tiers = make_tiers()
    assert tiers.backfill_records() == INITIAL_BACKFILL_RECORDS
    tiers.rate.add(300, 2.0)  # 150 records/s, 1 s budget
    assert tiers.backfill_records() == 150
    tiers.rate.add(1, 0.02)  # a one-record nearline batch barely moves it
    assert 140 <= tiers.backfill_records() <= 150
    fast = make_tiers()
    fast.rate.add(40_000, 1.0)
    assert fast.backfill_records() == 4096  # never above --batch-size
    slow = make_tiers()
    slow.rate.add(1, 10.0)
    assert slow.backfill_records() == MIN_BACKFILL_RECORDS


def test_only_backfill_batches_measure_the_rate() -> None:
    tiers = make_tiers()
    tiers.embedded(batch(LIVE, 1), 0.05)  # a nearline batch: the cost of one pass
    assert tiers.rate.records_per_s() is None
    backfill = batch(CORPUS, 2)
    backfill.good.extend(record(CORPUS, o)[0] for o in range(100))
    tiers.embedded(backfill, 0.5)
    assert tiers.backfill_records() == 200


def test_embed_rate_ignores_empty_batches() -> None:
    rate = EmbedRate()
    assert rate.records_per_s() is None
    rate.add(0, 1.0)
    rate.add(10, 0.0)  # every vector from the cache
    assert rate.records_per_s() is None
    rate.add(100, 1.0)
    assert rate.records_per_s() == pytest.approx(100.0)


# -- tiers of partitions, commits ----------------------------------------------------------


def test_tiers_of_partitions_and_commit_metadata() -> None:
    tiers = make_tiers()
    assert tiers.tier_of((LIVE, 0)) == NEARLINE
    assert tiers.tier_of(TopicPartition(CORPUS, 3)) == BACKFILL
    nearline, backfill = tiers.split([TopicPartition(LIVE, 0), TopicPartition(CORPUS, 1)])
    assert nearline == {TopicPartition(LIVE, 0)} and backfill == {TopicPartition(CORPUS, 1)}
    assert tier_from_metadata(tiers.commit_metadata((CORPUS, 0))) == BACKFILL
    assert tier_from_metadata(commit_metadata(NEARLINE)) == NEARLINE
    assert tier_from_metadata("") is None and tier_from_metadata(None) is None
    assert tier_from_metadata("tier=other") is None
    assert tier_from_metadata("something else") is None


def test_audit_tells_nearline_commits() -> None:
    from kafka.structs import OffsetAndMetadata

    from pipeline.audit.run import is_nearline

    assert is_nearline(OffsetAndMetadata(5, "tier=nearline", -1))
    assert not is_nearline(OffsetAndMetadata(5, "tier=backfill", -1))
    assert not is_nearline(OffsetAndMetadata(5, "", -1))


class CommitRecorder:
    def __init__(self) -> None:
        self.commits: list[dict[TopicPartition, Any]] = []

    def commit_async(self, offsets: dict[TopicPartition, Any]) -> Future:
        self.commits.append(offsets)
        return Future().success(None)


def test_commits_carry_the_tier() -> None:
    ownership = Ownership()
    ownership.assigned([(LIVE, 0), (CORPUS, 0)])
    consumer = CommitRecorder()
    committer = OffsetCommitter(consumer, ownership, metadata=make_tiers().commit_metadata)
    committer.add_position((LIVE, 0), 5, ownership.current((LIVE, 0)))
    committer.add_position((CORPUS, 0), 7, ownership.current((CORPUS, 0)))
    committer.commit(0.0)
    (offsets,) = consumer.commits
    assert offsets[TopicPartition(LIVE, 0)].offset == 5
    assert offsets[TopicPartition(LIVE, 0)].metadata == "tier=nearline"
    assert offsets[TopicPartition(CORPUS, 0)].metadata == "tier=backfill"
    plain = CommitRecorder()  # without tiers: no metadata, as before
    committer = OffsetCommitter(plain, ownership)
    committer.add_position((LIVE, 0), 6, ownership.current((LIVE, 0)))
    committer.commit(0.0)
    assert plain.commits[0][TopicPartition(LIVE, 0)].metadata == ""


# -- pauses per tier, lag --------------------------------------------------------------------


@pytest.fixture
def reader(tmp_path: Path) -> tuple[FakeConsumer, Reader]:
    consumer = FakeConsumer()
    reader = Reader(consumer, Ownership(), tmp_path, KafkaSettings())  # type: ignore[arg-type]
    return consumer, reader


def test_pause_only_reconciles_with_the_consumers_own_flags(reader) -> None:
    consumer, reader = reader
    live, corpus0, corpus1 = (
        TopicPartition(LIVE, 0),
        TopicPartition(CORPUS, 0),
        TopicPartition(CORPUS, 1),
    )
    consumer.assigned = {live, corpus0}
    assert reader.pause_only({corpus0}) == 1
    assert consumer.paused() == {corpus0}
    # A rebalance assigns corpus[1] (not paused by kafka-python) and keeps corpus[0]'s flag.
    consumer.assigned = {live, corpus0, corpus1}
    assert reader.pause_only({corpus0, corpus1}) == 2
    assert consumer.paused() == {corpus0, corpus1}
    # Revoked partitions are not paused (nor counted); backfill resumes.
    consumer.assigned = {live, corpus1}
    assert reader.pause_only({corpus0, corpus1}) == 1
    assert reader.pause_only(set()) == 0 and consumer.paused() & consumer.assigned == set()
    # Backpressure on everything, then off again: set_paused is pause_only of all.
    assert reader.set_paused(True) == 2 and reader.set_paused(False) == 0


class LagConsumer(FakeConsumer):
    def __init__(self) -> None:
        super().__init__()
        self.highwaters: dict[TopicPartition, int | None] = {}

    def highwater(self, tp: TopicPartition) -> int | None:
        return self.highwaters.get(tp)


def test_fetch_lag_is_highwater_minus_position_of_fetched_partitions() -> None:
    consumer = LagConsumer()
    a, b, c = (TopicPartition(LIVE, p) for p in range(3))
    consumer.positions = {a: 10, b: 5, c: 0}
    consumer.highwaters = {a: 15, b: 5}  # c never fetched: unknown, counts zero
    assert fetch_lag(consumer, [a, b, c]) == 5  # type: ignore[arg-type]
    consumer.highwaters[b] = 3  # a stale high watermark below the position
    assert fetch_lag(consumer, [b]) == 0  # type: ignore[arg-type]


class Slot:
    def __init__(self, left: bool) -> None:
        self.left = left

    def __bool__(self) -> bool:
        return self.left


class Fetcher:
    def __init__(self, slot: Slot | None, parked: dict) -> None:
        self._next_partition_records = slot
        self._paused_partition_records = parked


class WithFetcher:
    def __init__(self, fetcher: Fetcher) -> None:
        self._fetcher = fetcher


def test_unpark_empties_a_drained_slot_only_when_records_are_parked() -> None:
    parked = {TopicPartition(CORPUS, 1): object()}
    drained = WithFetcher(Fetcher(Slot(False), parked))
    assert unpark_resumed(drained) is True  # type: ignore[arg-type]
    assert drained._fetcher._next_partition_records is None
    busy = WithFetcher(Fetcher(Slot(True), parked))  # records still to hand out: keep
    assert unpark_resumed(busy) is False  # type: ignore[arg-type]
    assert busy._fetcher._next_partition_records is not None
    nothing_parked = WithFetcher(Fetcher(Slot(False), {}))
    assert unpark_resumed(nothing_parked) is False  # type: ignore[arg-type]
    assert unpark_resumed(object()) is False  # type: ignore[arg-type]  # another client


# -- queue and batches -------------------------------------------------------------------


def batch(topic: str, number: int) -> MicroBatch:
    b = MicroBatch(number=number)
    b.ranges[(topic, 0)] = [number, number]
    return b


def test_embed_queue_takes_nearline_first_each_tier_in_order() -> None:
    q = TierQueue(10, batch_is_backfill(make_tiers()))
    for item in (batch(CORPUS, 1), batch(CORPUS, 2), batch(LIVE, 3), batch(CORPUS, 4)):
        q.put(item)
    q.put(batch(LIVE, 5))
    assert q.qsize() == 5 and q.nearline_waiting()
    # Every nearline batch before any backfill one; each tier in the order it came.
    assert [q.get().number for _ in range(3)] == [3, 5, 1]
    assert not q.nearline_waiting()
    q.put(batch(LIVE, 6))
    assert [q.get().number for _ in range(3)] == [6, 2, 4]
    assert q.qsize() == 0


def test_a_backfill_batch_takes_only_nearline_batches_out_of_the_queue() -> None:
    q = TierQueue(3, batch_is_backfill(make_tiers()))
    q.put(batch(CORPUS, 1))
    assert q.take_nearline() is None  # a backfill batch never jumps ahead this way
    q.put(batch(LIVE, 2))
    q.put(batch(LIVE, 3))
    assert q.full()
    assert q.take_nearline().number == 2
    q.put(batch(LIVE, 4), timeout=1)  # the slot it freed is free to the producer
    assert [q.take_nearline().number, q.take_nearline().number] == [3, 4]
    assert q.take_nearline() is None and q.get().number == 1


def test_in_flight_batches_are_counted_per_tier() -> None:
    tiers = make_tiers()
    ownership = Ownership()
    ownership.in_flight.started(1, [(LIVE, 0)])
    ownership.in_flight.started(2, [(CORPUS, 0), (CORPUS, 1)])
    ownership.in_flight.started(3, [(CORPUS, 1)])
    assert ownership.in_flight.count(tiers.holds_backfill) == 2
    ownership.in_flight.finished(2)
    assert ownership.in_flight.count(tiers.holds_backfill) == 1 and len(ownership.in_flight) == 2


def record(topic: str, offset: int) -> tuple[GoodRecord, list[int]]:
    source = SourceRecord(topic, 0, offset, 0, None, b'{"text": "x"}')
    return GoodRecord(source, "x", None, None), [1, 2, 3]


def test_batches_never_mix_tiers() -> None:
    clock = Clock()
    tiers = make_tiers(clock)
    batcher = TieredBatcher.around(tiers, Batcher(100, 10_000, 0.5, clock=clock))
    batcher.backfill.max_records = 3
    batcher.start((LIVE, 0), 0)
    batcher.start((CORPUS, 0), 0)
    pairs = [record(CORPUS, 0), record(LIVE, 0), record(CORPUS, 1), record(CORPUS, 2)]
    closed = batcher.add(pairs, lambda key: 1)
    assert [set(b.ranges) for b in closed] == [{(CORPUS, 0)}]  # backfill full at 3
    assert batcher.pending == 1 and batcher.is_open
    assert set(batcher.nearline.flush(CloseReason.CAUGHT_UP).ranges) == {(LIVE, 0)}
    assert not batcher.is_open


def test_flush_and_due_close_one_tier_at_a_time_even_an_empty_batch() -> None:
    clock = Clock()
    batcher = TieredBatcher.around(make_tiers(clock), Batcher(100, 10_000, 0.5, clock=clock))
    batcher.start((LIVE, 0), 0)
    batcher.start((CORPUS, 0), 0)
    batcher.advance((CORPUS, 0), 5, 1)  # offsets without records (transaction markers)
    batcher.add([record(LIVE, 0)], lambda key: 1)
    assert batcher.seconds_until_due() == pytest.approx(0.5)
    clock.now += 0.6
    first, second = batcher.due(), batcher.due()
    assert first is not None and set(first.ranges) == {(LIVE, 0)}
    assert second is not None and second.ranges == {(CORPUS, 0): [0, 4]} and len(second) == 0
    assert batcher.due() is None and batcher.flush(CloseReason.SHUTDOWN) is None
    batcher.add([record(LIVE, 1), record(CORPUS, 5)], lambda key: 1)
    batcher.drop({(CORPUS, 0)})
    flushed = batcher.flush(CloseReason.SHUTDOWN)
    assert flushed is not None and set(flushed.ranges) == {(LIVE, 0)}
    assert batcher.flush(CloseReason.SHUTDOWN) is None


def test_a_held_nearline_batch_does_not_close_by_age() -> None:
    clock = Clock()
    batcher = TieredBatcher.around(make_tiers(clock), Batcher(100, 10_000, 0.5, clock=clock))
    held = [True]
    batcher.hold_nearline = lambda: held[0]
    batcher.start((LIVE, 0), 0)
    batcher.add([record(LIVE, 0)], lambda key: 1)
    clock.now += 1.0
    assert batcher.due() is None  # overdue, but the previous nearline batch still waits
    assert batcher.seconds_until_due() is None  # and the poll loop does not spin on it
    held[0] = False
    assert batcher.seconds_until_due() == 0
    due = batcher.due()
    assert due is not None and set(due.ranges) == {(LIVE, 0)}


# -- configuration -------------------------------------------------------------------------


def test_config_validates_backfill_topics() -> None:
    base = dict(group="g", output=Path("/o"))
    config = WorkerConfig.of(topics=(LIVE, CORPUS), backfill_topics=(CORPUS,), **base)
    assert config.input.backfill_topics == (CORPUS,)
    with pytest.raises(ConfigError, match="not among the topics"):
        WorkerConfig.of(topics=(LIVE,), backfill_topics=(CORPUS,), **base)
    with pytest.raises(ConfigError, match="besides"):
        WorkerConfig.of(topics=(CORPUS,), backfill_topics=(CORPUS,), **base)
    with pytest.raises(ConfigError, match="backfill batch"):
        WorkerConfig.of(
            topics=(LIVE, CORPUS), backfill_topics=(CORPUS,), backfill_batch_ms=0, **base
        )


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[WorkerConfig]:
    for name in list(os.environ):
        if name.startswith("PIPELINE_"):
            monkeypatch.delenv(name)
    configs: list[WorkerConfig] = []
    monkeypatch.setattr(cli.run, "run_worker", configs.append)
    return configs


def test_cli_backfill_topic_flags(captured: list[WorkerConfig]) -> None:
    run = ["run", "--topic", LIVE, "--group", "g", "--output", "/o"]
    result = CliRunner().invoke(
        cli.main, [*run, "--backfill-topic", CORPUS, "--backfill-topic", "old"]
    )
    assert result.exit_code == 0, result.output
    (config,) = captured
    assert config.topics == (LIVE, CORPUS, "old")
    assert config.input.backfill_topics == (CORPUS, "old")
    assert config.batching.backfill_batch_ms == 1000
    assert config.dead_letter_topic == "live.dlq"
    result = CliRunner().invoke(cli.main, [*run, "--backfill-topic", LIVE])
    assert result.exit_code == ConfigError.exit_code
    assert "either --topic or --backfill-topic" in result.output
    result = CliRunner().invoke(
        cli.main, run, env={"PIPELINE_BACKFILL_TOPIC": CORPUS, "PIPELINE_BACKFILL_BATCH_MS": "250"}
    )
    assert result.exit_code == 0, result.output
    assert (
        captured[-1].input.backfill_topics == (CORPUS,)
        and captured[-1].batching.backfill_batch_ms == 250
    )


# -- pipeline status -------------------------------------------------------------------------


def row(topic: str, partition: int, lag: int, verdict: str, throughput: float | None) -> dict:
    return {
        "topic": topic,
        "partition": partition,
        "committed": 10,
        "end": 10 + lag,
        "lag": lag,
        "lag_seconds": None,
        "owner": None,
        "throughput": throughput,
        "verdict": verdict,
        "lag_verdict": verdict,
    }


def test_status_rows_get_their_tier_and_backfill_waiting_is_not_a_stall() -> None:
    rows = [
        row(LIVE, 0, 500, OK, 120.0),  # nearline catching up
        row(CORPUS, 0, 9000, STALLED, 0.0),
        row(CORPUS, 1, 9000, STALLED, 0.0),  # no commit of its own with a tier yet
        row("other", 0, 0, OK, None),
    ]
    apply_tiers(rows, {(LIVE, 0): NEARLINE, (CORPUS, 0): BACKFILL})
    assert [r["tier"] for r in rows] == [NEARLINE, BACKFILL, BACKFILL, None]
    assert [r["verdict"] for r in rows] == [OK, LAGGING, LAGGING, OK]
    assert rows[1]["waiting"] == NEARLINE and rows[0]["waiting"] is None


def test_backfill_stalls_when_nearline_does_not_move_or_has_no_lag() -> None:
    still = [row(LIVE, 0, 500, STALLED, 0.0), row(CORPUS, 0, 9000, STALLED, 0.0)]
    apply_tiers(still, {(LIVE, 0): NEARLINE, (CORPUS, 0): BACKFILL})
    assert [r["verdict"] for r in still] == [STALLED, STALLED]
    idle = [row(LIVE, 0, 0, OK, 20.0), row(CORPUS, 0, 9000, STALLED, 0.0)]
    apply_tiers(idle, {(LIVE, 0): NEARLINE, (CORPUS, 0): BACKFILL})
    assert idle[1]["verdict"] == STALLED and idle[1]["waiting"] is None
    mismatch = [row(LIVE, 0, 5, OK, 20.0), row(CORPUS, 0, 9000, STALLED, 0.0)]
    mismatch[1]["verdict"] = MISMATCH
    apply_tiers(mismatch, {(LIVE, 0): NEARLINE, (CORPUS, 0): BACKFILL})
    assert mismatch[1]["verdict"] == MISMATCH and mismatch[1]["lag_verdict"] == LAGGING


def report(rows: list[dict]) -> dict:
    return {
        "group": "g",
        "total_lag": sum(r["lag"] for r in rows),
        "partitions": rows,
        "output": None,
    }


def test_status_table_shows_tiers_only_for_tiered_groups() -> None:
    plain = [row(LIVE, 0, 0, OK, None)]
    apply_tiers(plain, {})
    assert "TIER" not in render_table(report(plain))
    rows = [row(LIVE, 0, 500, OK, 120.0), row(CORPUS, 0, 9000, STALLED, 0.0)]
    apply_tiers(rows, {(LIVE, 0): NEARLINE, (CORPUS, 0): BACKFILL})
    table = render_table(report(rows)).splitlines()
    assert table[1].split()[-1] == "TIER"
    assert table[2].split()[-1] == NEARLINE
    assert table[3].endswith("backfill (waits for nearline)")


# -- a backfill batch gives way between its passes -----------------------------------------


def texts_batch(embedder: Any, topic: str, number: int, texts: list[str]) -> MicroBatch:
    b = MicroBatch(number=number)
    tokens = embedder.tokenize(texts)
    for offset, (text, ids) in enumerate(zip(texts, tokens.ids, strict=True)):
        source = SourceRecord(topic, 0, offset, 0, None, b"")
        b.good.append(GoodRecord(source, text, None, None))
        b.token_ids.append(ids)
    b.ranges[(topic, 0)] = [0, len(texts) - 1]
    return b


def test_a_nearline_batch_overtakes_the_backfill_batch_being_embedded(tiny_model: str) -> None:
    import queue
    import threading

    import numpy as np

    from consumers.stages import EmbedStage
    from pipeline.core.metrics import WorkerMetrics
    from pipeline.model.embedder import Embedder

    # A small token budget: the backfill batch takes many passes.
    embedder = Embedder.load(tiny_model, precision="fp32", device="cpu", sub_batch_tokens=64)
    inbox = TierQueue(4, batch_is_backfill(make_tiers()))
    outbox: queue.Queue[Any] = queue.Queue()
    stage = EmbedStage(inbox, outbox, threading.Event(), embedder, WorkerMetrics())
    backfill = texts_batch(embedder, CORPUS, 1, [f"backfill text number {i}" for i in range(60)])
    nearline = texts_batch(embedder, LIVE, 2, ["a nearline record", "and another"])
    calls = []

    def urgent() -> MicroBatch | None:
        calls.append(len(calls))
        if len(calls) == 2:  # arrives while the backfill batch is under way
            inbox.put(nearline)
        return inbox.take_nearline()

    stage.yields = batch_is_backfill(make_tiers())
    stage.urgent = urgent
    try:
        expected, _ = embedder.embed_tokens(backfill.tokenized())
        stage.handle(backfill)
    finally:
        embedder.close()
    first, second = outbox.get_nowait(), outbox.get_nowait()
    assert (first.batch.number, second.batch.number) == (2, 1)
    assert second.stats.forward_passes > 3 and len(calls) >= second.stats.forward_passes
    assert np.allclose(second.vectors, expected, atol=1e-6)  # unchanged by the interruption


# -- fair backfill ---------------------------------------------------------------------


def test_fair_share_pauses_the_partition_ahead_until_the_others_catch_up() -> None:
    from consumers.tiers import FairShare

    a, b, c = (TopicPartition(CORPUS, p) for p in range(3))
    fair = FairShare()
    lags = {a: 5000, b: 5000, c: 0}  # c has nothing to read: it holds nobody back
    assert fair.ahead(lags, 64) == set()
    fair.took((CORPUS, 0), 64)  # one fetch's records come from one partition at a time
    assert fair.ahead(lags, 64) == {a}
    fair.took((CORPUS, 1), 40)  # a is less than a quantum ahead now: both read
    assert fair.ahead(lags, 64) == set()
    fair.took((CORPUS, 1), 100)  # b is a quantum past a: b waits, a reads
    assert fair.ahead(lags, 64) == {b}
    # A partition that was idle and now has records starts level, with no credit.
    lags[c] = 10
    assert fair.ahead(lags, 64) == set()
    fair.took((CORPUS, 2), 64)
    assert fair.ahead(lags, 64) == {c}
    # One lagging partition alone is never paused, whatever it took.
    assert fair.ahead({a: 1, b: 0, c: 0}, 64) == set()
    fair.took((CORPUS, 0), 10_000)
    assert fair.ahead({a: 1, b: 0, c: 0}, 64) == set()
