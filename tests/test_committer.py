"""OffsetCommitter: commits go out without waiting for the broker, one at a time; a
partition counts as committed only once acknowledged; failures and silence are
retried with what is pending then; partitions given up never come back."""

from __future__ import annotations

import time
from typing import Any

import kafka.errors as kerrors
from kafka import TopicPartition
from kafka.future import Future

from consumers.committer import OffsetCommitter, PublishedBatch
from consumers.partitions import Ownership

A, B = ("t", 0), ("t", 1)


class Coordinator:
    """Stands for the consumer's commit_async: keeps each commit's future to answer."""

    def __init__(self) -> None:
        self.sent: list[tuple[dict[TopicPartition, Any], Future]] = []

    def commit_async(self, offsets: dict[TopicPartition, Any]) -> Future:
        future = Future()
        self.sent.append(({tp: meta.offset for tp, meta in offsets.items()}, future))
        return future

    def offsets(self, n: int = -1) -> dict[tuple[str, int], int]:
        return {(tp.topic, tp.partition): o for tp, o in self.sent[n][0].items()}


def make(**kwargs: Any) -> tuple[OffsetCommitter, Coordinator, Ownership]:
    ownership = Ownership()
    ownership.assigned([A, B])
    coordinator = Coordinator()
    return OffsetCommitter(coordinator, ownership, **kwargs), coordinator, ownership


def published(ownership: Ownership, number: int, **offsets: int) -> PublishedBatch:
    keys = {"a": A, "b": B}
    next_offsets = {keys[k]: v for k, v in offsets.items()}
    epochs = {key: ownership.current(key) for key in next_offsets}
    return PublishedBatch(number, next_offsets, epochs, rows=1, dead_lettered=0, opened_at=number)


def test_one_commit_out_at_a_time_and_committed_only_once_acknowledged() -> None:
    committer, coordinator, ownership = make()
    committer.add(published(ownership, 1, a=10, b=5))
    assert committer.commit(0.0) is None
    assert coordinator.offsets() == {A: 10, B: 5}
    assert committer.has_pending and committer.sending and committer.committed == {}
    committer.add(published(ownership, 2, a=20))
    assert committer.commit(0.0) is None
    assert len(coordinator.sent) == 1  # the first is still out
    coordinator.sent[0][1].success(None)
    acknowledged = committer.commit(0.0)
    assert acknowledged is not None and acknowledged.opened_at == [1]
    assert committer.committed == {A: 10, B: 5}
    assert coordinator.offsets() == {A: 20}  # what was pending went out at once
    coordinator.sent[1][1].success(None)
    acknowledged = committer.commit(0.0)
    assert acknowledged is not None and acknowledged.opened_at == [2]
    assert committer.committed == {A: 20, B: 5} and not committer.has_pending


def test_a_failed_commit_is_retried_after_the_pause_with_what_is_pending() -> None:
    committer, coordinator, ownership = make(retry_s=1.0)
    committer.add(published(ownership, 1, a=10))
    committer.commit(100.0)
    coordinator.sent[0][1].failure(kerrors.RebalanceInProgressError())
    committer.add(published(ownership, 2, a=15, b=3))
    assert committer.commit(100.2) is None
    assert committer.failing_since == 100.2 and committer.failures == 1
    assert len(coordinator.sent) == 1 and committer.committed == {}
    assert committer.commit(100.9) is None and len(coordinator.sent) == 1  # pausing
    committer.commit(101.3)
    assert coordinator.offsets() == {A: 15, B: 3}
    coordinator.sent[1][1].success(None)
    acknowledged = committer.commit(101.4)
    assert acknowledged is not None and acknowledged.opened_at == [1, 2]
    assert committer.failing_since is None and committer.committed == {A: 15, B: 3}


def test_an_unanswered_commit_is_given_up_after_the_timeout_and_sent_again() -> None:
    committer, coordinator, ownership = make(timeout_ms=50, retry_s=0.0)
    committer.add(published(ownership, 1, a=10))
    committer.commit(0.0)
    assert committer.commit(0.0, wait_s=0.02) is None and len(coordinator.sent) == 1
    committer.commit(0.0, wait_s=0.06)  # past the timeout: failed, and sent again
    assert committer.failures == 1 and len(coordinator.sent) == 2
    assert coordinator.offsets() == {A: 10}


def test_waits_for_the_answer_when_asked() -> None:
    import threading

    committer, coordinator, ownership = make()
    committer.add(published(ownership, 1, a=10))
    committer.commit(0.0)
    threading.Timer(0.05, lambda: coordinator.sent[0][1].success(None)).start()
    acknowledged = committer.commit(0.0, wait_s=2.0)
    assert acknowledged is not None and committer.committed == {A: 10}


def test_partitions_given_up_while_a_commit_is_out_do_not_come_back() -> None:
    committer, coordinator, ownership = make()
    committer.add(published(ownership, 1, a=10, b=5))
    committer.commit(0.0)
    ownership.revoked([B], lost=False)
    committer.forget({B})
    coordinator.sent[0][1].success(None)
    committer.commit(0.0)
    assert committer.committed == {A: 10}
    committer.add_position(B, 9, 1)  # a position of an epoch gone: not owned now
    committer.commit(0.0)
    assert len(coordinator.sent) == 1 and not committer.has_pending


def test_commits_failing_in_a_rebalance_log_no_warning_and_others_one_per_streak(
    caplog: Any,
) -> None:
    import logging

    committer, coordinator, ownership = make(retry_s=0.0)
    caplog.set_level(logging.DEBUG, logger="consumers.committer")
    now = 100.0
    for error in (kerrors.RebalanceInProgressError(), kerrors.CommitFailedError()) * 5:
        committer.add(published(ownership, int(now), a=int(now)))
        committer.commit(now)
        coordinator.sent[-1][1].failure(error)
        now += 1.0
        committer.commit(now)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [] and committer.failures == 10
    for _ in range(20):  # a broker that keeps refusing, for 20 s: told once, not 20 times
        committer.add(published(ownership, int(now), a=int(now)))
        committer.commit(now)
        coordinator.sent[-1][1].failure(kerrors.KafkaTimeoutError())
        now += 1.0
        committer.commit(now)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "KafkaTimeoutError" in warnings[0]


class Stopping:
    """Stands for a worker as it stops: its committer, and the commit step it flushes
    with, its commits answered as `answer` says."""

    def __init__(self, answer: BaseException | None) -> None:
        self.committer, self.coordinator, ownership = make(retry_s=0.05)
        self.committer.add(published(ownership, 1, a=10))
        self.answer = answer

    def collect(self, wait_s: float) -> None:
        self.committer.commit(time.monotonic(), wait_s)
        for _, future in self.coordinator.sent:
            if not future.is_done:
                future.failure(self.answer) if self.answer else future.success(None)


def test_a_stopping_worker_does_not_wait_for_commits_a_rebalance_refuses(caplog: Any) -> None:
    """A stopping worker does not rejoin: a commit refused because the group is
    rebalancing could only succeed in a generation it will not be part of. Workers
    stopped together waited out the whole shutdown timeout for it."""
    import logging

    caplog.set_level(logging.INFO, logger="consumers.committer")
    refused = Stopping(kerrors.RebalanceInProgressError())
    started = time.monotonic()
    refused.committer.flush(refused.collect, 60.0)
    assert time.monotonic() - started < 5.0
    assert refused.committer.has_pending and refused.committer.rebalancing
    assert "the group is rebalancing" in caplog.text and "not acknowledged" not in caplog.text

    # Another failure is retried until the timeout, as before.
    failing = Stopping(kerrors.KafkaTimeoutError())
    failing.committer.flush(failing.collect, 0.5)
    assert len(failing.coordinator.sent) > 1 and failing.committer.has_pending
    assert "not acknowledged after" in caplog.text

    # A rebalance refusal from before the stop (the worker has rejoined since) does not
    # end the wait: the commit is sent again, and answered.
    rejoined = Stopping(None)
    rejoined.committer.rebalancing = True
    rejoined.committer.flush(rejoined.collect, 60.0)
    assert not rejoined.committer.has_pending and rejoined.committer.committed == {A: 10}
