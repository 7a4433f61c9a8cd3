"""The rebalance state machine (consumers/partitions.py) against a stand-in for the
consumer's local state: where every assignment starts, what a fence does, pauses
reconciled with the consumer's own flags, and the revoke wait. No broker: the
integration tests (test_rebalance.py, scripts/chaos/) cover the real thing."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from kafka import TopicPartition
from kafka.errors import IllegalStateError

from consumers.partitions import Change, Listener, Ownership, Reader
from pipeline.core.config import KafkaSettings
from pipeline.core.layout import SegmentKey, quarantine_dir, vectors_dir
from pipeline.core.model_info import ModelInfo
from pipeline.core.records import GoodRecord, SourceRecord
from sinks.parquet import ParquetSink
from sinks.segments import START_FROM_COMMITTED

T = "topic"


class FakeConsumer:
    """The consumer's local partition state, as kafka-python keeps it."""

    def __init__(self, beginning: int = 0) -> None:
        self.assigned: set[TopicPartition] = set()
        self.paused_set: set[TopicPartition] = set()
        self.positions: dict[TopicPartition, int] = {}
        self.commits: dict[TopicPartition, int] = {}
        self.beginning = beginning

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def paused(self) -> set[TopicPartition]:
        return set(self.paused_set)

    def pause(self, *tps: TopicPartition) -> None:
        self.paused_set |= set(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self.paused_set -= set(tps)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.positions[tp] = offset

    def position(self, tp: TopicPartition, timeout_ms: int | None = None) -> int | None:
        return self.positions.get(tp)

    def committed(self, tp: TopicPartition, timeout_ms: int | None = None) -> int | None:
        return self.commits.get(tp)

    def beginning_offsets(self, tps: list[TopicPartition], timeout_ms: int) -> dict:
        return dict.fromkeys(tps, self.beginning)


def model_info() -> ModelInfo:
    return ModelInfo("m", "/m", "r", 4, "mean", True, 128, "fp32", "cpu")


def publish(output: Path, partition: int, first: int, last: int) -> Path:
    sink = ParquetSink(output, model_info())
    sink.prepare()
    source = SourceRecord(T, partition, first, 0, None, b"{}")
    record = GoodRecord(source, "x", None, None)
    staged = sink.stage(
        SegmentKey(T, partition, first), last, [record], np.ones((1, 4), np.float32), 1
    )
    assert sink.publish(staged)
    return staged.final_path


@pytest.fixture
def world(tmp_path: Path) -> tuple[FakeConsumer, Ownership, Reader]:
    consumer = FakeConsumer()
    ownership = Ownership()
    reader = Reader(consumer, ownership, tmp_path, KafkaSettings())  # type: ignore[arg-type]
    return consumer, ownership, reader


def assign(consumer: FakeConsumer, ownership: Ownership, *partitions: int) -> None:
    """What kafka-python does on an assignment: the listener runs, the assignment grows."""
    consumer.assigned |= {TopicPartition(T, p) for p in partitions}
    ownership.assigned([(T, p) for p in partitions])


def revoke(consumer: FakeConsumer, ownership: Ownership, *partitions: int) -> None:
    consumer.assigned -= {TopicPartition(T, p) for p in partitions}
    ownership.revoked([(T, p) for p in partitions], lost=False)


def test_a_partition_starts_past_the_outputs_else_at_the_commit_else_at_its_beginning(
    world, tmp_path: Path
) -> None:
    consumer, ownership, reader = world
    consumer.beginning = 5
    publish(tmp_path, 0, 0, 9)
    publish(tmp_path, 0, 10, 41)  # outputs end at 41; the commit lags behind
    consumer.commits[TopicPartition(T, 0)] = 10
    consumer.commits[TopicPartition(T, 1)] = 70  # nothing written: the commit says where
    assign(consumer, ownership, 0, 1, 2)

    applied = reader.apply()

    assert applied.started == {(T, 0): 42, (T, 1): 70, (T, 2): 5}
    assert consumer.positions == {TopicPartition(T, p): o for p, o in [(0, 42), (1, 70), (2, 5)]}
    # The group's commit catches up with what the outputs already hold.
    assert applied.commit_to == {(T, 0): 42, (T, 2): 5}
    assert reader.states[(T, 1)].start_note == START_FROM_COMMITTED
    assert reader.states[(T, 0)].start_note is None
    assert applied.changes == [Change.ASSIGNED.value]


def test_a_kept_partition_is_sought_back_to_where_the_outputs_end(world, tmp_path: Path) -> None:
    # An eager rebalance revokes and re-assigns a partition this worker keeps;
    # kafka-python keeps its fetch position, past batches the revocation dropped.
    consumer, ownership, reader = world
    assign(consumer, ownership, 0)
    reader.apply()
    publish(tmp_path, 0, 0, 127)
    consumer.positions[TopicPartition(T, 0)] = 384  # polled up to here, 256 dropped
    consumer.paused_set.add(TopicPartition(T, 0))  # and it was paused by backpressure
    revoke(consumer, ownership, 0)
    assign(consumer, ownership, 0)

    applied = reader.apply()

    assert applied.started == {(T, 0): 128}
    assert consumer.positions[TopicPartition(T, 0)] == 128
    assert reader.set_paused(False) == 0
    assert consumer.paused() == set()  # the pause kafka-python kept is undone


def test_set_paused_reconciles_with_the_consumers_own_flags(world) -> None:
    consumer, ownership, reader = world
    assign(consumer, ownership, 0, 1)
    reader.apply()
    assert reader.set_paused(True) == 2
    assert consumer.paused() == {TopicPartition(T, 0), TopicPartition(T, 1)}
    consumer.assigned.add(TopicPartition(T, 2))  # joined while paused
    assert reader.set_paused(True) == 3
    assert reader.set_paused(False) == 0 and consumer.paused() == set()


def test_records_below_the_next_offset_are_refused_and_gaps_are_covered(world) -> None:
    consumer, ownership, reader = world
    assign(consumer, ownership, 0)
    reader.apply()  # starts at 0
    assert reader.accept((T, 0), 0) and reader.accept((T, 0), 1)
    assert not reader.accept((T, 0), 1)  # fetched twice
    assert not reader.accept((T, 9), 0)  # not owned
    consumer.positions[TopicPartition(T, 0)] = 5  # a marker and aborted records passed
    assert reader.skipped_to((T, 0)) == 5
    assert reader.skipped_to((T, 0)) is None
    assert not reader.accept((T, 0), 4)


def test_a_position_unknown_meanwhile_skips_nothing_but_a_bug_is_raised(
    world, monkeypatch: pytest.MonkeyPatch
) -> None:
    consumer, ownership, reader = world
    assign(consumer, ownership, 0)
    reader.apply()

    def position(error: Exception):
        def raising(tp: TopicPartition, timeout_ms: int | None = None) -> int:
            raise error

        return raising

    monkeypatch.setattr(consumer, "position", position(IllegalStateError("not assigned")))
    assert reader.skipped_to((T, 0)) is None
    monkeypatch.setattr(consumer, "position", position(TypeError("a bug")))
    with pytest.raises(TypeError):  # before: read as "nothing skipped"
        reader.skipped_to((T, 0))


def test_a_polled_run_keeps_only_records_at_or_past_the_next_offset(world) -> None:
    consumer, ownership, reader = world
    assign(consumer, ownership, 0)
    reader.apply()  # starts at 0
    run = [SourceRecord(T, 0, o, 0, None, b"{}") for o in range(0, 4)]
    assert reader.accept_run((T, 0), run) == run  # all new: the run itself
    again = [SourceRecord(T, 0, o, 0, None, b"{}") for o in range(2, 7)]
    assert [r.offset for r in reader.accept_run((T, 0), again)] == [4, 5, 6]
    assert reader.accept_run((T, 0), again) == []  # fetched twice
    assert reader.accept_run((T, 9), run) == [] and reader.accept_run((T, 0), []) == []
    assert not reader.accept((T, 0), 6) and reader.accept((T, 0), 7)


def test_a_fence_stops_publishing_and_restarts_where_the_outputs_now_end(
    world, tmp_path: Path
) -> None:
    consumer, ownership, reader = world
    assign(consumer, ownership, 0)
    reader.apply()
    polled_in = reader.epoch((T, 0))
    # Another worker published from offset 0 first: this one lost the race.
    publish(tmp_path, 0, 0, 63)
    ownership.fence((T, 0), polled_in)
    with ownership.lock:
        assert not ownership.owns((T, 0), polled_in)
    # Until the poll loop applies it, records keep the old epoch: never published.
    assert reader.epoch((T, 0)) == polled_in

    applied = reader.apply()

    assert applied.started == {(T, 0): 64}
    assert reader.epoch((T, 0)) == ownership.current((T, 0)) != polled_in
    ownership.fence((T, 0), polled_in)  # a late second loss of the same epoch: nothing
    assert reader.apply().changed == set()


def test_a_damaged_last_segment_is_moved_aside_and_read_again(world, tmp_path: Path) -> None:
    consumer, ownership, reader = world
    publish(tmp_path, 0, 0, 9)
    damaged = publish(tmp_path, 0, 10, 19)
    damaged.write_bytes(damaged.read_bytes()[:50])
    assign(consumer, ownership, 0)

    assert reader.apply().started == {(T, 0): 10}
    assert not damaged.exists()
    assert any(quarantine_dir(tmp_path).glob("*.json"))
    assert [p.name for p in vectors_dir(tmp_path).glob("*.parquet")] == [
        SegmentKey(T, 0, 0).filename
    ]


def test_revocation_waits_for_embedded_work_but_a_loss_does_not(world) -> None:
    consumer, ownership, _ = world
    listener = Listener(ownership, revoke_timeout_s=5)
    assign(consumer, ownership, 0, 1, 2)
    ownership.in_flight.started(1, [(T, 0)])
    ownership.in_flight.embedded(1)  # being written: published within moments
    ownership.in_flight.started(3, [(T, 0), (T, 2)])  # not embedded yet: not waited for
    threading.Timer(0.3, ownership.in_flight.finished, args=(1,)).start()
    started = time.monotonic()
    listener.on_partitions_revoked({TopicPartition(T, 0)})
    assert 0.2 < time.monotonic() - started < 4
    assert ownership.owned() == {(T, 1), (T, 2)}
    # Batch 3 goes on for (T, 2); nothing of it is published for (T, 0) any more.
    assert not ownership.owns((T, 0), 1)
    started = time.monotonic()
    listener.on_partitions_revoked({TopicPartition(T, 2)})
    assert time.monotonic() - started < 0.2  # batch 3 is still being embedded
    ownership.in_flight.finished(3)

    ownership.in_flight.started(2, [(T, 1)])
    started = time.monotonic()
    listener.on_partitions_lost({TopicPartition(T, 1)})
    assert time.monotonic() - started < 0.2  # another member may own it already
    assert ownership.owned() == set()
    changes = [e.change for e in ownership.events()]
    assert changes == [Change.ASSIGNED, Change.REVOKED, Change.REVOKED, Change.LOST]


def test_waiting_for_room_ends_when_a_batch_is_published_not_at_the_timeout(world) -> None:
    """The poll loop, with every partition paused for the batches in flight, waits
    for one of them to be published (consumers.worker._make_room)."""
    _, ownership, _ = world
    in_flight = ownership.in_flight
    in_flight.started(1, [(T, 0)])
    in_flight.started(2, [(T, 1)])
    assert not in_flight.wait_fewer_than(2, timeout_s=0.05)
    threading.Timer(0.1, in_flight.finished, args=(1,)).start()
    started = time.monotonic()
    assert in_flight.wait_fewer_than(2, timeout_s=10)
    assert time.monotonic() - started < 5
    assert len(in_flight) == 1
    assert in_flight.wait_fewer_than(2, timeout_s=0)  # already room: no wait


def test_records_polled_before_a_partition_was_sought_are_not_taken(world, tmp_path: Path) -> None:
    # The group committed up to 333, but the outputs end at 327 (the last segment
    # was damaged and moved aside): the poll that assigned the partition returned
    # records from 333, fetched before the seek to 328. Taking them would claim
    # 328..332 as read.
    consumer, ownership, reader = world
    publish(tmp_path, 0, 310, 327)
    consumer.commits[TopicPartition(T, 0)] = 333
    assign(consumer, ownership, 0, 1)
    polled = {TopicPartition(T, 0): ["record@333"], TopicPartition(T, 7): ["other"]}

    applied = reader.apply()

    assert applied.started[(T, 0)] == 328
    assert applied.unchanged(polled) == {TopicPartition(T, 7): ["other"]}
    assert reader.apply().unchanged(polled) == polled  # nothing changed since


# -- one line per rebalance ----------------------------------------------------------------


def test_a_rebalance_is_one_line_that_the_chaos_harness_reads_back(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    import logging
    import subprocess
    import sys

    from consumers.partitions import Change, Event, RebalanceLog

    now = [100.0]
    rebalances = RebalanceLog(clock=lambda: now[0])
    rejoining = type("C", (), {"_coordinator": type("K", (), {"need_rejoin": lambda s: flag[0]})()})
    flag = [False]
    with caplog.at_level(logging.DEBUG, logger="consumers.partitions"):
        now[0] = 103.25  # subscribed at 100: the first join took 3.25 s
        rebalances.applied(
            [Event(Change.ASSIGNED, frozenset({("t", 0), ("t", 1), ("t", 2)}))],
            set(),
            {("t", 0): 5, ("t", 1): 0, ("t", 2): 7},
        )
        now[0] = 200.0
        rebalances.watch(rejoining())  # no rebalance yet
        flag[0] = True
        now[0] = 210.0
        rebalances.watch(rejoining())  # the heartbeat learnt of one
        now[0] = 211.5
        rebalances.applied(
            [Event(Change.REVOKED, frozenset({("t", 2)}))], {("t", 0), ("t", 1), ("t", 2)}, {}
        )
        rebalances.closed([Event(Change.REVOKED, frozenset({("t", 0), ("t", 1)}))])
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "partitions joined the group in 3.2s: assigned t[0]@5 t[1]@0 t[2]@7; revoked none; "
        "kept none",
        "partitions rebalanced in 1.5s: assigned none; revoked t[2]; kept t[0] t[1]",
        "partitions revoked at close: t[0] t[1]",
    ]
    # The chaos harness replays ownership from these lines (scripts/chaos/fleet.py).
    log = tmp_path / "worker.log"
    stamp = "2026-12-03 12:00:00,000 INFO consumers.partitions"
    log.write_text("\n".join(f"{stamp}: {line}" for line in lines[:2]))
    script = (
        "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path;"
        "from chaos.fleet import WorkerProc;"
        f"w = WorkerProc('w', None, Path({str(log)!r}), False, 0.0, 1);"
        "print(sorted(w.owned()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        check=True,
    )
    assert out.stdout.strip() == "[('t', 0), ('t', 1)]"
