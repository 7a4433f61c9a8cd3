"""One retry helper (pipeline/core/retry.py) behind the four loops that wait out a
failure: the object store's create that raced another (409), the index's commit lost
to another writer, the offset committer and the embedding cache's breaker. Each keeps
what it retried, how often, its pauses and what it says when it gives up; and none
retries a bug (a TypeError is raised at once, not reported as a store or a cluster
that keeps failing). No broker, no S3 server (botocore's Stubber answers)."""

from __future__ import annotations

import math
from typing import Any

import kafka.errors as kerrors
import pytest
from botocore.stub import Stubber
from kafka import TopicPartition
from kafka.future import Future

from consumers.committer import OffsetCommitter, PublishedBatch
from consumers.partitions import Ownership
from consumers.tiers import partition_lags
from pipeline.core import retry as retry_module
from pipeline.core.errors import OutputError
from pipeline.core.retry import Backoff, RetryGate, retry
from sinks.objectstore import ObjectStore


@pytest.fixture
def pauses(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The pauses `retry` takes, instead of sleeping them."""
    taken: list[float] = []
    monkeypatch.setattr(retry_module.time, "sleep", taken.append)
    return taken


# ------------------------------------------------------------------ the helper


def test_backoff_grows_to_its_ceiling_and_jitters_within_its_share() -> None:
    assert [Backoff(1.0, 2.0, 30.0)(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert Backoff(1.0, factor=1.0)(500) == 1.0
    assert Backoff(1.0, 2.0, 30.0)(100_000) == 30.0  # failing for days: no overflow
    assert Backoff(1.0)(100_000) == math.inf
    for n in range(1, 10):
        assert 0.05 * 2 ** (n - 1) <= Backoff(0.05, 2.0, jitter=1.0)(n) <= 0.1 * 2 ** (n - 1)


def test_retry_retries_what_it_is_told_and_raises_the_last_failure(pauses: list[float]) -> None:
    calls: list[int] = []

    def flaky(fails: int) -> str:
        calls.append(1)
        if len(calls) <= fails:
            raise ConnectionError(f"try {len(calls)}")
        return "done"

    assert retry(lambda: flaky(2), on=ConnectionError, attempts=5, pause=Backoff(1.0)) == "done"
    assert len(calls) == 3 and pauses == [1.0, 2.0]

    calls.clear()
    pauses.clear()
    with pytest.raises(ConnectionError, match="try 3"):
        retry(lambda: flaky(10), on=ConnectionError, attempts=3, pause=Backoff(1.0))
    assert len(calls) == 3 and pauses == [1.0, 2.0]  # no pause after the last try


def refused() -> None:
    raise ConnectionError("refused")


def test_retry_lets_a_bug_and_a_failure_it_does_not_want_through_at_once(
    pauses: list[float],
) -> None:
    def bug() -> None:
        raise TypeError("a bug")

    with pytest.raises(TypeError):
        retry(bug, on=ConnectionError, attempts=5, pause=Backoff(1.0))
    with pytest.raises(ConnectionError):
        retry(
            refused,
            on=ConnectionError,
            when=lambda exc: "reset" in str(exc),
            attempts=5,
            pause=Backoff(1.0),
        )
    assert pauses == []


def test_the_gate_opens_a_pause_after_each_try_and_keeps_the_streaks_start() -> None:
    gate = RetryGate(Backoff(1.0, 2.0, 30.0))
    assert gate.ready(0.0) and gate.failing_since is None
    assert gate.failed(10.0) == 1.0
    assert not gate.ready(10.5) and gate.ready(11.0)
    assert gate.failed(12.0, tried_at=11.5) == 2.0  # counted from the try, not the answer
    assert not gate.ready(13.4) and gate.ready(13.5)
    assert gate.failing_since == 10.0 and gate.failures == 2
    gate.succeeded()
    assert gate.ready(13.5) and gate.failing_since is None and gate.failures == 0
    assert gate.failed(20.0) == 1.0  # a new streak starts from the first pause


# ------------------------------------------------------------------ the object store


@pytest.fixture
def store() -> ObjectStore:
    return ObjectStore(
        "bucket", "out", endpoint="http://127.0.0.1:1", access_key="k", secret_key="s"
    )


def stubbed(store: ObjectStore, *answers: int) -> Stubber:
    """put_object answering each HTTP status in turn (200: created)."""
    stubber = Stubber(store._client)
    codes = {409: "ConditionalRequestConflict", 412: "PreconditionFailed", 500: "InternalError"}
    for status in answers:
        if status == 200:
            stubber.add_response("put_object", {})
        else:
            stubber.add_client_error(
                "put_object", service_error_code=codes[status], http_status_code=status
            )
    stubber.activate()
    return stubber


def test_a_create_that_raced_another_is_tried_again_until_the_store_answers(
    store: ObjectStore, pauses: list[float]
) -> None:
    stubber = stubbed(store, 409, 409, 200)
    assert store.put_if_absent("vectors/a.parquet", b"x") is True
    stubber.assert_no_pending_responses()
    assert len(pauses) == 2 and 0.05 <= pauses[0] <= 0.1 and 0.1 <= pauses[1] <= 0.2

    stubber.deactivate()
    pauses.clear()
    stubbed(store, 409, 412)
    assert store.put_if_absent("vectors/a.parquet", b"x") is False  # the other one won
    assert len(pauses) == 1


def test_a_create_that_keeps_racing_gives_up_in_one_line(
    store: ObjectStore, pauses: list[float]
) -> None:
    store.conflict_retries = 3
    stubber = stubbed(store, 409, 409, 409, 409)
    with pytest.raises(OutputError, match=r"cannot create s3://bucket/out/k at .*409"):
        store.put_if_absent("k", b"x")
    stubber.assert_no_pending_responses()  # 1 + conflict_retries tries
    assert len(pauses) == 3 and pauses[2] <= 0.4


def test_other_store_errors_are_not_retried_and_bugs_are_not_translated(
    store: ObjectStore, pauses: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    stubber = stubbed(store, 500)
    with pytest.raises(OutputError, match="InternalError"):
        store.put_if_absent("k", b"x")
    assert pauses == []
    stubber.deactivate()

    def bug(**kwargs: Any) -> None:
        raise TypeError("put_object() got an unexpected keyword argument")

    monkeypatch.setattr(store._client, "put_object", bug)
    for write in (store.put_if_absent, store.put):
        with pytest.raises(TypeError):
            write("k", b"x")


def test_every_request_translates_store_errors_the_same_way(store: ObjectStore) -> None:
    stubber = Stubber(store._client)
    fail = dict(service_error_code="AccessDenied", http_status_code=403)
    for operation in ("get_object", "delete_object", "list_objects_v2", "head_object"):
        stubber.add_client_error(operation, **fail)
    stubber.add_client_error("get_object", service_error_code="NoSuchKey", http_status_code=404)
    stubber.add_client_error("head_object", service_error_code="404", http_status_code=404)
    stubber.add_response("list_objects_v2", {})  # the bucket is there: the key is not
    stubber.activate()
    for call in (
        lambda: store.get("k"),
        lambda: store.delete("k"),
        lambda: list(store.list()),
        lambda: store.exists("k"),
    ):
        with pytest.raises(OutputError, match=r"access denied to s3://bucket/out/"):
            call()
    with pytest.raises(FileNotFoundError, match="no object s3://bucket/out/k"):
        store.get("k")
    assert store.exists("k") is False
    stubber.assert_no_pending_responses()


# ------------------------------------------------------------------ the index commit


def test_a_lost_index_commit_is_tried_again_then_given_up_in_one_line(
    tmp_path: Any, pauses: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sinks.index import store as index_store

    index = index_store.IndexStore(tmp_path)
    tries: list[int] = []

    def attempt(stats: Any) -> None:
        tries.append(1)
        index._meta = object()  # type: ignore[assignment]
        if len(tries) < 4:
            raise index_store._LostCommit
        stats.added = 7

    assert index._until_committed(attempt) == 7
    assert len(tries) == 4 and len(pauses) == 3
    assert all(0.05 * n <= p <= 0.5 * n for n, p in enumerate(pauses, 1))

    def always_lost(stats: Any) -> None:
        index._meta = object()  # type: ignore[assignment]
        raise index_store._LostCommit

    pauses.clear()
    with pytest.raises(OutputError, match="changed under 20 commits in a row"):
        index._until_committed(always_lost)
    assert len(pauses) == 19 and index._meta is None  # read again by whoever comes next


# ------------------------------------------------------------------ offset commits


class Consumer:
    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error
        self.futures: list[Future] = []

    def commit_async(self, offsets: dict[TopicPartition, Any]) -> Future:
        if self.error is not None:
            raise self.error
        self.futures.append(Future())
        return self.futures[-1]


def committer(consumer: Consumer) -> OffsetCommitter:
    ownership = Ownership()
    ownership.assigned([("t", 0)])
    made = OffsetCommitter(consumer, ownership, retry_s=1.0)
    made.add(PublishedBatch(1, {("t", 0): 10}, {("t", 0): ownership.current(("t", 0))}, 1, 0))
    return made


def test_a_commit_is_retried_on_kafka_errors_a_pause_after_its_try() -> None:
    consumer = Consumer()
    commits = committer(consumer)
    commits.commit(100.0)
    consumer.futures[0].failure(kerrors.NodeNotReadyError("coordinator 1"))
    commits.commit(100.7)  # the answer: failed; a pause from the try, not the answer
    assert commits.failing_since == 100.7 and len(consumer.futures) == 1
    commits.commit(101.0)
    assert len(consumer.futures) == 2
    consumer.futures[1].success(None)
    commits.commit(101.1)
    assert commits.failing_since is None and commits.committed == {("t", 0): 10}


@pytest.mark.parametrize("where", ["commit_async", "answer"])
def test_a_bug_in_a_commit_is_raised_not_retried(where: str) -> None:
    bug = TypeError("offsets must be dict[TopicPartition, OffsetAndMetadata]")
    consumer = Consumer(bug if where == "commit_async" else None)
    commits = committer(consumer)
    if where == "answer":
        commits.commit(0.0)
        consumer.futures[0].failure(bug)
    with pytest.raises(TypeError, match="offsets must be"):
        commits.commit(0.0)
    assert commits.failing_since is None  # not a cluster that keeps failing


# ------------------------------------------------------------------ the tiers' lag


class Positions:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def highwater(self, tp: TopicPartition) -> int:
        return 10

    def position(self, tp: TopicPartition, timeout_ms: int | None = None) -> int:
        if tp.partition == 0:
            raise self.error
        return 4


def test_lag_skips_a_partition_unassigned_meanwhile_but_not_a_bug() -> None:
    tps = [TopicPartition("t", 0), TopicPartition("t", 1)]
    unassigned = Positions(kerrors.IllegalStateError("Partition is not assigned"))
    assert partition_lags(unassigned, tps) == {tps[1]: 6}  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # before: read as "no lag", and backfill never waited
        partition_lags(Positions(TypeError("a bug")), tps)  # type: ignore[arg-type]
