"""The commit protocol, in one place.

For each micro-batch, in batch order:

  1. stage   the offset range of each of its partitions is written to a temp
             Parquet file and fsynced (`ParquetSink.stage`); a range covers
             every offset the consumer passed, records or not, so that
             consecutive segments of a partition tile its offsets;
  2. dead-letter  its bad records that no earlier owner of the partition sent
             are sent and flushed (consumers.dead_letters: each exactly once);
  3. publish each temp file is linked to its final name, create-if-absent, and
             the directory fsynced. Steps 2 and 3 happen only for partitions this
             worker still owns in the epoch its records were polled in
             (`Ownership.owns`), only while the group has heard this worker
             lately, and under the revocation's lock;
  4. commit  the offset past each published range is committed to Kafka, from
             the consumer thread, again only for partitions still owned. Commits
             are sent without waiting for the broker's answer (one out at a
             time, the latest offsets in the next); the worker waits for the
             answers only as it stops (`OffsetCommitter.flush`), and a partition
             counts as committed only once acknowledged.

So an offset is committed only when every record below it is in a published
segment or acknowledged by the dead-letter topic. The output directory, not
Kafka, is the truth: a partition is (re)started exactly past what its segments
cover (`consumers.partitions`), so a crash between 3 and 4 leaves no duplicate.

Fencing: a segment's name is its first offset, and publishing is a
create-if-absent of that name. A worker that stalled past its session timeout
and comes back still believes it owns its partitions; the new owner started
where the outputs ended, which is where the stalled worker's next segment
starts too, so both race for the same name and exactly one wins. The loser
fences the partition (`Ownership.fence`): nothing more it polled of it is
published, and it reads the partition again from where the outputs now end.
Revocation and publication exclude each other through `Ownership.lock`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kafka.errors as kerrors
from kafka import TopicPartition
from kafka.structs import OffsetAndMetadata

from consumers.partitions import Ownership
from pipeline.core.layout import TopicPartitionKey
from pipeline.core.retry import Backoff, RetryGate

log = logging.getLogger(__name__)

# Commit errors that only say the group is rebalancing: the commit is retried once
# the worker has rejoined (or dropped for partitions it no longer owns).
_REBALANCING = (
    kerrors.RebalanceInProgressError,
    kerrors.CommitFailedError,
    kerrors.IllegalGenerationError,
    kerrors.UnknownMemberIdError,
)
# What a commit may fail with and be retried: the cluster's errors, and no answer in
# time. Anything else (a TypeError from the client, its network thread gone) is a bug
# and is raised, not retried until the worker reports a cluster that does not answer.
_RETRIED = (kerrors.KafkaError, TimeoutError)
# A commit failing for another reason is told at its first failure, then this often.
_WARN_EVERY_S = 30.0


@dataclass
class PublishedBatch:
    """What a finished batch lets the committer commit."""

    number: int
    next_offsets: dict[TopicPartitionKey, int]
    epochs: dict[TopicPartitionKey, int]
    rows: int
    dead_lettered: int
    # Of the rows, those that are a chunked record's second chunk or later.
    later_chunks: int = 0
    dropped_partitions: set[TopicPartitionKey] = field(default_factory=set)
    opened_at: float = 0.0  # when the batch's first record was polled (monotonic)


@dataclass(frozen=True)
class Acknowledged:
    """A commit the broker accepted."""

    seconds: float  # from sending it to learning of its answer
    opened_at: list[float]  # first-record times of the batches it covered


@dataclass
class _Sent:
    future: Any  # kafka.future.Future
    offsets: dict[TopicPartitionKey, int]
    opened_at: list[float]
    at: float  # perf_counter when sent


class OffsetCommitter:
    """Commits published offsets; runs on the consumer's thread only."""

    def __init__(
        self,
        consumer: object,
        ownership: Ownership,
        timeout_ms: int = 10_000,
        metadata: Callable[[TopicPartitionKey], str] | None = None,
        retry_s: float = 1.0,
    ) -> None:
        self._consumer = consumer
        self._ownership = ownership
        self._timeout_ms = timeout_ms
        # The committed offset's metadata per partition (consumers.tiers: its tier).
        self._metadata = metadata
        self._pending: dict[TopicPartitionKey, tuple[int, int]] = {}
        self._opened: list[float] = []  # batches published since the last commit sent
        self._sent: _Sent | None = None
        self._last_try = float("-inf")
        self._gate = RetryGate(Backoff(retry_s, factor=1.0))  # `retry_s` after the try
        self.committed: dict[TopicPartitionKey, int] = {}
        self.failures = 0
        # The last commit failed because the group is rebalancing (retried once the
        # worker has rejoined; a worker that stops does not rejoin).
        self.rebalancing = False
        self._last_warned = float("-inf")

    @property
    def failing_since(self) -> float | None:
        """When the commits' current streak of failures began (None: not failing)."""
        return self._gate.failing_since

    def add(self, published: PublishedBatch) -> None:
        for key, offset in published.next_offsets.items():
            self.add_position(key, offset, published.epochs[key])
        self._opened.append(published.opened_at)

    def add_position(self, key: TopicPartitionKey, offset: int, epoch: int) -> None:
        """Commits `offset` for `key` on the next commit, if it moves the commit forward."""
        current = self._pending.get(key)
        if (current is None or offset > current[0]) and offset > self.committed.get(key, -1):
            self._pending[key] = (offset, epoch)

    def forget(self, keys: set[TopicPartitionKey]) -> None:
        """Partitions this worker no longer reads: their next owner commits them."""
        for key in keys:
            self._pending.pop(key, None)
            self.committed.pop(key, None)
            if self._sent is not None:
                self._sent.offsets.pop(key, None)  # its answer must not bring them back

    @property
    def has_pending(self) -> bool:
        """Offsets not yet acknowledged (waiting to be sent, or sent and unanswered)."""
        return bool(self._pending) or self._sent is not None

    def commit(self, now: float, wait_s: float = 0.0) -> Acknowledged | None:
        """Learns the answer to the commit out (waiting up to `wait_s` for it), then
        sends the pending offsets of owned partitions if none is out; returns the
        commit acknowledged by this call, if any. A failed commit is retried after
        `retry_s`, with whatever is pending by then."""
        acknowledged = self._answer(now, wait_s)
        if self._sent is not None or not self._pending:
            return acknowledged
        if not self._gate.ready(now):
            return acknowledged
        self._last_try = now
        offsets = self._owned_offsets()
        if not offsets:
            return acknowledged
        try:
            future = self._consumer.commit_async(offsets=offsets)  # type: ignore[attr-defined]
        except kerrors.KafkaError as exc:  # no coordinator known yet, ...: retried
            self._failed(now, exc)
            return acknowledged
        sent = {(tp.topic, tp.partition): meta.offset for tp, meta in offsets.items()}
        self._sent = _Sent(future, sent, self._opened, time.perf_counter())
        self._opened = []
        return acknowledged

    def flush(self, collect: Callable[[float], None], timeout_s: float) -> None:
        """As the worker stops: calls `collect(wait_s)` (which commits what was
        published, waiting up to wait_s for the answer) until nothing is pending, for
        at most `timeout_s`. A commit refused because the group is rebalancing is not
        waited for: a stopping worker does not rejoin, so it could only succeed in a
        generation this worker will not be part of (workers stopped together waited
        out the whole timeout, each one's leaving a rebalance for the others)."""
        deadline = time.monotonic() + timeout_s
        failures = self.failures
        while self.has_pending and time.monotonic() < deadline:
            collect(min(0.5, max(0.0, deadline - time.monotonic())))
            if self.rebalancing and self.failures > failures:
                log.info(
                    "shutdown: the group is rebalancing, so offsets are left uncommitted; "
                    "the partitions' next owner resumes where the outputs end"
                )
                return
            if not self.sending:
                time.sleep(0.05)  # a failed commit's retry pause
        if self.has_pending:
            log.warning(
                "shutdown: offsets not acknowledged after %.0fs; a restart resumes from the "
                "outputs, which hold everything published",
                timeout_s,
            )

    @property
    def sending(self) -> bool:
        """Whether a commit is out, waiting for its answer."""
        return self._sent is not None

    def _owned_offsets(self) -> dict[TopicPartition, OffsetAndMetadata]:
        offsets = {}
        with self._ownership.lock:
            for key, (offset, epoch) in list(self._pending.items()):
                if self._ownership.owns(key, epoch):
                    meta = "" if self._metadata is None else self._metadata(key)
                    offsets[TopicPartition(*key)] = OffsetAndMetadata(offset, meta, -1)
                else:
                    del self._pending[key]  # the next owner starts from the outputs
        return offsets

    def _answer(self, now: float, wait_s: float) -> Acknowledged | None:
        sent = self._sent
        if sent is None:
            return None
        deadline = time.perf_counter() + wait_s
        while not sent.future.is_done and time.perf_counter() < deadline:
            time.sleep(0.002)
        error: BaseException | None
        if not sent.future.is_done:
            if time.perf_counter() - sent.at < self._timeout_ms / 1000:
                return None
            # Unanswered past the request timeout: sent again with what is pending.
            error = TimeoutError(f"no answer in {self._timeout_ms / 1000:.0f}s")
        else:
            error = None if sent.future.succeeded() else sent.future.exception
        self._sent = None
        if error is not None and not isinstance(error, _RETRIED):
            raise error
        if error is not None:
            self._opened = sent.opened_at + self._opened
            self._failed(now, error)
            return None
        self._gate.succeeded()
        self.rebalancing = False
        for key, offset in sent.offsets.items():
            if offset > self.committed.get(key, -1):
                self.committed[key] = offset
            if self._pending.get(key, (None,))[0] == offset:
                del self._pending[key]
        return Acknowledged(time.perf_counter() - sent.at, sent.opened_at)

    def _failed(self, now: float, exc: BaseException) -> None:
        # CommitFailed, RebalanceInProgress, broker restarts: retried
        self.failures += 1
        first = self._gate.failing_since is None
        self._gate.failed(now, tried_at=self._last_try)
        self.rebalancing = isinstance(exc, _REBALANCING)
        if self.rebalancing:
            # The group is rebalancing: expected, retried, and its one line is the
            # rebalance's own (consumers.partitions.RebalanceLog).
            log.debug("offset commit failed during a rebalance (retrying): %s", exc)
        elif first or now - self._last_warned >= _WARN_EVERY_S:
            self._last_warned = now
            log.warning("offset commit failed (retrying): %s", exc)
        else:
            log.debug("offset commit failed (retrying): %s", exc)
