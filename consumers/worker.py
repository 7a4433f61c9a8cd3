"""The worker: poll, parse, tokenize and batch on this thread; embed and write on
two stage threads; commit back on this thread (the consumer is not thread-safe).
Where a tokenizer process runs (consumers.tokenize_process), a poll's texts are
tokenized there while this thread polls the next, and its records join the batcher
right after that next poll returns: before the poll's rebalance, restarts or
skipped offsets touch the batcher, so everything reaches it in poll order.

Backpressure: at most `max_in_flight` batches are between poll and commit.
When that many are out, every owned partition is paused and `poll()` keeps
being called (it returns nothing for paused partitions), so the worker stays in
its group however slow a batch is, and memory stays bounded by the batches in
flight plus the consumer's fetch buffers, whatever the backlog. Between those
polls the loop waits for a batch to be published (a poll tick at most), not for
a paused poll's timeout: reading resumes as soon as there is room.

Rebalances, positions and fencing live in `consumers.partitions`; the commit
protocol in `consumers.committer`; damaged outputs in `consumers.repair`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import kafka.errors as kerrors
from kafka import KafkaConsumer, TopicPartition

from consumers import derived, repair, startup
from consumers.batcher import CloseReason, MicroBatch
from consumers.bulk import BulkEnd
from consumers.committer import OffsetCommitter, PublishedBatch
from consumers.dead_letters import DeadLetterLedger
from consumers.flow import flow_control
from consumers.partitions import Applied, Ownership, Reader, caught_up_with
from consumers.stages import Stage, check_stages, start_stages
from consumers.summary import RunSummary, account, time_spent, update_lag
from consumers.tokenize_process import TokenizerPool
from pipeline.core.config import WorkerConfig
from pipeline.core.documents import Keyed, paired
from pipeline.core.errors import BrokerUnavailable, PipelineError
from pipeline.core.host import freeze_start_up_objects, process_age_s
from pipeline.core.metrics import WorkerMetrics
from pipeline.core.records import BadRecord, GoodRecord, RecordParser, Source
from pipeline.kafka import cluster, internals, record_batches
from pipeline.kafka.dead_letter import DeadLetterSink
from pipeline.model.cache import EmbeddingCache, open_cache
from pipeline.model.chunking import Chunker, shaped_rows
from pipeline.model.embedder import Embedder, TokenIds
from sinks.index import shards as index_shards
from sinks.index.store import IndexStore
from sinks.parquet import ParquetSink
from sinks.view import ViewStore

log = logging.getLogger(__name__)
T = TypeVar("T")

_POLL_TICK_MS = 100
_END_CHECK_INTERVAL_S = 1.0
_END_CHECK_IDLE_S = 0.2  # nothing in flight: the end may just have been reached
_LAG_METRIC_INTERVAL_S = 2.0
_COMMIT_RETRY_S = 1.0
# The longest poll while a commit's answer is awaited.
_COMMIT_ANSWER_TICK_MS = 10
# How long a worker that is failing waits for the commits of what it published.
_FAILURE_COMMIT_WAIT_S = 5.0
# Polls of fewer texts (unless full) are tokenized here: a trickle gains nothing from
# the overlap, and its records reach a batch without waiting for another poll.
TOKENIZER_PROCESS_MIN_TEXTS = 256


# Decoding problems no retry mends: name the partition and offset, and stop.
class Worker:
    def __init__(
        self,
        config: WorkerConfig,
        model: Embedder | Future[Embedder],
        shutdown: threading.Event,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.config = config
        self._model = model
        # Set by _attach_model, once the model has loaded (it loads during the checks).
        self.embedder: Embedder
        self.parquet: ParquetSink
        self.chunker: Chunker
        self.shutdown = shutdown
        self.metrics = metrics or WorkerMetrics()
        self.summary = RunSummary()
        self.ownership = Ownership()
        self.in_flight = self.ownership.in_flight
        self.parser = RecordParser(
            config.input.text_field, config.input.id_field, config.input.max_text_bytes
        )
        self.documents = config.documents  # None: append mode
        # How records are batched, partitions paused and batches ordered (consumers.flow).
        self.flow = flow_control(config)
        self.batcher = self.flow.batcher
        # The embed queue's bound is what bounds the batches between poll and commit.
        self._embed_q: queue.Queue[MicroBatch] = self.flow.embed_queue
        # The worker only adds to the index; `pipeline search` chooses the GPU.
        self.index = IndexStore(config.output)
        # Upsert mode's current view (sinks.view), kept by a stage of its own.
        view_index = IndexStore(config.output)  # the view stage's own: a thread apart
        self.view = ViewStore(config.output, index=view_index) if self.documents else None
        self.dead_letter = DeadLetterSink(
            config.kafka, config.dead_letter_topic, timeout_s=config.liveness.broker_timeout_s
        )
        self.dead_letters = DeadLetterLedger(self.dead_letter, config.output)
        self._stop_stages = threading.Event()
        self._write_q: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._done_q: queue.Queue[PublishedBatch] = queue.Queue()
        self._consumer: KafkaConsumer | None = None
        self._reader: Reader | None = None
        self._tokenizer: TokenizerPool | None = None
        # A poll's records whose parses and ids the tokenizer process has yet to
        # send; at most one poll's worth.
        self._pending: list[Source] | None = None
        self._committer: OffsetCommitter | None = None
        self._stages: list[Stage] = []
        self._bulk: BulkEnd | None = None
        self._last_lag_update = 0.0
        self._admin: Any = None
        self.cache: EmbeddingCache | None = None  # opened with the model (pipeline.model.cache)
        # The revoke wait runs on kafka-python's IO thread and holds up heartbeats:
        # with a heartbeat due every third of the session timeout, a wait of another
        # third keeps the session alive, and well inside the rebalance timeout.
        self._revoke_timeout_s = min(
            config.liveness.revoke_timeout_s,
            config.liveness.session_timeout_ms / 3000,
            config.liveness.max_poll_interval_ms / 2000,
        )

    # -- life cycle ----------------------------------------------------------------

    def run(self) -> RunSummary:
        """Runs until the end (bulk mode), a signal, or an error; returns a summary."""
        try:
            with contextlib.ExitStack() as resources:
                self._admin = resources.enter_context(cluster.admin_client(self.config.kafka))
                return self._run()
        except kerrors.KafkaError as exc:
            # Every expected Kafka failure is retried or mapped where it happens;
            # one that slips through still ends in one line, not a traceback.
            if cluster.is_retriable(exc):
                raise cluster.unreachable(self.config.kafka, exc) from exc
            raise PipelineError(f"Kafka refused the worker: {exc}") from exc

    def _run(self) -> RunSummary:
        checked = startup.preflight(self.config, self._admin)
        if self.config.input.until_end:
            self._bulk = BulkEnd(
                self.config, checked.end_targets, checked.progress, self._check_cluster_health
            )
        committed = checked.committed
        self._attach_model()
        removed = self.parquet.prepare()
        if removed:
            log.info("removed %d temp file(s) left by dead or stalled writers", removed)
        self._repair(committed)
        derived.catch_up(self.index, self.view, self.metrics, starting=True)
        self._consumer = startup.make_consumer(self.config, self.ownership, self._revoke_timeout_s)
        self._reader = Reader(
            self._consumer,
            self.ownership,
            self.config.output,
            self.config.kafka,
            on_quarantine=self.metrics.quarantined.inc,
        )
        self._committer = OffsetCommitter(
            self._consumer,
            self.ownership,
            metadata=self.flow.commit_metadata,
            retry_s=_COMMIT_RETRY_S,
        )
        self._stages = start_stages(
            self.config,
            self.embedder,
            self.cache,
            self.parquet,
            self.dead_letters,
            self.index,
            self.ownership,
            self.metrics,
            (self._embed_q, self._write_q, self._done_q),
            self._stop_stages,
            heard_within=lambda s: internals.heard_within(self._consumer, s),
            view=self.view,
        )
        self.flow.attach(self._stages[0])
        try:
            self._loop()
            self._drain(self.config.liveness.shutdown_timeout_s)
        except PipelineError:
            self._commit_published()
            raise
        finally:
            self._close()
        return self.summary

    def _attach_model(self) -> None:
        """Waits for the model (loading since start-up) and opens the sinks it shapes."""
        model = self._model
        self.embedder = model.result() if isinstance(model, Future) else model
        self.parquet, self.chunker = startup.output_sink(self.config, self.embedder)
        self.cache = open_cache(self.config, self.embedder.info, self.metrics)
        index_shards.preload(self.embedder.info.dim)
        self.parquet.preload()
        self._tokenizer = startup.tokenizer_pool(self.config, self.embedder, self.parser)
        freeze_start_up_objects()

    def _tokenizer_takes(self, records: int) -> bool:
        """Whether the tokenizer process takes this poll's records: a full poll, or 256
        records or more, once it is ready."""
        if self._tokenizer is None or records < min(
            TOKENIZER_PROCESS_MIN_TEXTS, self.config.batching.batch_size
        ):
            return False
        try:
            return self._tokenizer.ready()
        except PipelineError as exc:  # it did not start (timed out, killed): tokenize here
            log.warning("tokenizer process: off (%s); the poll loop tokenizes", exc)
            self._tokenizer = None
            return False

    def _repair(self, committed: dict[TopicPartition, int]) -> None:
        report = repair.repair_outputs(
            self.config,
            self.embedder,
            self.parser,
            self.parquet,
            {(tp.topic, tp.partition): offset for tp, offset in committed.items()},
        )
        self.metrics.quarantined.inc(report.quarantined)
        self.metrics.repaired.inc(report.repaired)

    # -- the poll loop -------------------------------------------------------------

    def _loop(self) -> None:
        last_end_check = 0.0
        while not self.shutdown.is_set():
            check_stages(self._stages, self._stop_stages)
            self._collect_published()
            blocked = self._make_room()
            # With a poll's ids still to come, the next poll only takes what is there;
            # with every partition still paused, the wait for room was the poll's wait.
            timeout = 0 if self._pending is not None or blocked else self._poll_timeout_ms()
            polled = self._apply_rebalance(self._poll(timeout))
            if polled:
                if self.summary.first_record_at is None:
                    self.summary.first_record_at = time.monotonic()
                    self.summary.cpu_at_first_record = os.times()
                    log.info("first record polled %.1fs after process start", process_age_s())
                self._ingest(polled)
            if self._pending is None:
                # (With a poll's records still out of the batcher, nothing is caught
                # up, and no offset past them may be covered as skipped.)
                self._cover_skipped_offsets()
                self._close_caught_up(empty_poll=not polled, timeout=timeout)
            due = self.batcher.due()
            if due is not None:
                self._hand_off(due)
            self._update_lag_metrics()
            idle = not len(self.in_flight) and not self.batcher.is_open and not self._pending
            check_every = _END_CHECK_IDLE_S if idle else _END_CHECK_INTERVAL_S
            if self.config.input.until_end and time.monotonic() - last_end_check > check_every:
                last_end_check = time.monotonic()
                if self._reached_end():
                    log.info("bulk mode: the group's committed offsets reached the end")
                    return
        log.info("shutdown requested: finishing the batches in flight")

    def _close_caught_up(self, empty_poll: bool, timeout: int) -> None:
        assert self._consumer is not None

        def caught_up(only: set[TopicPartition] | None) -> bool:
            # A short empty poll (one taken while a tokenized poll was due) proves
            # nothing by itself: the positions say it.
            full_poll = empty_poll and timeout >= _POLL_TICK_MS
            return caught_up_with(self._consumer, full_poll, only)

        for batch in self.flow.caught_up_batches(self._consumer.assignment(), caught_up):
            self._hand_off(batch)

    def _poll(self, timeout_ms: int) -> dict[Any, list[Any]]:
        assert self._consumer is not None
        try:
            polled = self._consumer.poll(timeout_ms=timeout_ms, max_records=self.flow.poll_records)
            failure = None
        except kerrors.KafkaError as exc:
            polled, failure = {}, exc
        # The previous poll's records join the batcher before anything this poll
        # brought (a rebalance, a restart out of range) touches it.
        self._finish_pending()
        if failure is None:
            return polled
        if isinstance(failure, kerrors.NoOffsetForPartitionError):
            return {}  # assigned during this poll; _apply_rebalance() seeks it next
        if isinstance(failure, kerrors.OffsetOutOfRangeError):
            self._out_of_range(failure.args[0] if failure.args else {})
            return {}
        if isinstance(failure, record_batches.UNDECODABLE):
            raise repair.undecodable_at(self._consumer, self.config.kafka, failure) from failure
        if cluster.is_retriable(failure):
            log.debug("poll: %s (retrying)", failure)
            return {}
        topics = ", ".join(self.config.topics)
        raise PipelineError(f"consuming {topics} failed: {failure}") from failure

    def _poll_timeout_ms(self) -> int:
        tick = _POLL_TICK_MS
        if self._committer is not None and self._committer.sending:
            tick = _COMMIT_ANSWER_TICK_MS  # its answer is learnt between polls
        until_due = self.batcher.seconds_until_due()
        if until_due is None:
            return tick
        return max(0, min(tick, int(until_due * 1000)))

    def _ingest(self, polled: dict[Any, list[Any]]) -> None:
        assert self._reader is not None
        sources: list[Source] = []
        for tp, records in polled.items():
            sources += self._reader.accept_run((tp.topic, tp.partition), records)
        if not sources:
            return
        self.flow.count_polled(sources, self.metrics)
        assert self._pending is None, "the previous poll's records come first"
        if self._tokenizer_takes(len(sources)):
            assert self._tokenizer is not None
            # Parsed and tokenized there while the next poll is decoded here.
            self._tokenizer.submit_values([s.value for s in sources])
            self._pending = sources  # joins the batcher after the next poll
            return
        parsed = [self.parser.parse(s) for s in sources]
        self._add(*shaped_rows(self.embedder, self.chunker, parsed))

    def _finish_pending(self) -> None:
        """Adds the records the tokenizer process was parsing and tokenizing."""
        if self._pending is None:
            return
        assert self._tokenizer is not None
        sources, self._pending = self._pending, None
        self._add(*self._tokenizer.parsed_result(sources))

    def _add(
        self, parsed: list[GoodRecord | BadRecord], token_ids: list[TokenIds], truncated: int
    ) -> None:
        assert self._reader is not None
        if truncated:
            self.metrics.truncated.inc(truncated)
        pairs: list[tuple[Keyed, TokenIds | None]]
        if len(token_ids) == len(parsed) and self.documents is None:  # no bad record: in C
            pairs = list(zip(parsed, token_ids, strict=True))
        else:
            pairs = paired(parsed, token_ids, self.documents)
        for batch in self.batcher.add(pairs, self._reader.epoch):
            self._hand_off(batch)

    def _cover_skipped_offsets(self) -> None:
        """Offsets the consumer passed without a record (transaction markers,
        aborted or compacted records) join the open batch's ranges, so that
        commits, and `--until-end`, reach the end of transactional topics."""
        assert self._reader is not None
        for key in list(self._reader.states):
            offset = self._reader.skipped_to(key)
            if offset is not None:
                self.batcher.advance(key, offset, self._reader.epoch(key))

    def _hand_off(self, batch: MicroBatch) -> None:
        assert self._reader is not None
        # Drop what was polled under an assignment that has since changed.
        stale = {k for k, e in batch.epochs.items() if self._reader.epoch(k) != e}
        if stale:
            batch = batch.without(stale)
        if not batch.ranges:
            return
        for key, (first, _) in batch.ranges.items():
            note = self._reader.take_start_note(key, first)
            if note is not None:
                batch.start_notes[key] = note
        self.in_flight.started(batch.number, batch.ranges)
        reason = batch.closed_by.value if batch.closed_by else "unknown"
        log.debug("batch %d: closed (%s) with %d records", batch.number, reason, batch.records)
        self.metrics.batches_closed.labels(reason).inc()
        self.metrics.in_flight.set(len(self.in_flight))
        self.metrics.batch_records.observe(batch.records)
        while True:
            try:
                self._embed_q.put(batch, timeout=0.1)
                return
            except queue.Full:
                check_stages(self._stages, self._stop_stages)

    def _make_room(self) -> bool:
        """Flow control. While every owned partition is paused for the batches in
        flight, waits (a poll tick at most) for one of them to be published: a paused
        poll would sleep its whole timeout however soon that happens. Returns whether
        every partition is still paused."""
        if not self._flow_control() or self._pending is not None:
            return False
        out = len(self.in_flight)
        if not out:
            return False  # paused for another reason (consumers.tiers): a poll's wait
        if self.in_flight.wait_fewer_than(out, self._poll_timeout_ms() / 1000):
            self._collect_published()
            return self._flow_control()
        return True

    def _flow_control(self) -> bool:
        """Pauses and resumes partitions; returns whether every owned one is paused."""
        assert self._reader is not None and self._consumer is not None
        paused = self.flow.pause(self._consumer, self._reader, self.in_flight, self.metrics)
        self.metrics.paused.set(paused)
        return paused > 0 and paused == len(self._consumer.assignment())

    def _collect_published(self, wait_s: float = 0.0) -> None:
        assert self._committer is not None
        for published in _take_all(self._done_q):
            self._committer.add(published)
            account(self.summary, self.metrics, published)
        acknowledged = self._committer.commit(time.monotonic(), wait_s)
        if acknowledged is not None:
            self.metrics.commit_seconds.observe(acknowledged.seconds)
            self.summary.last_commit_at = time.monotonic()
            for opened_at in acknowledged.opened_at:
                self.metrics.batch_latency.observe(self.summary.last_commit_at - opened_at)
        self._check_cluster_health(self._committer.failing_since, "committing offsets")
        self.metrics.in_flight.set(len(self.in_flight))

    def _flush_commits(self, timeout_s: float) -> None:
        """Waits (bounded) for the answers to the commits of everything published, as
        the worker stops: commits are otherwise sent without waiting."""
        assert self._committer is not None
        self._committer.flush(self._collect_published, timeout_s)

    def _check_cluster_health(self, failing_since: float | None, what: str) -> None:
        if failing_since is None:
            return
        timeout_s = self.config.liveness.broker_timeout_s
        if time.monotonic() - failing_since > timeout_s:
            raise BrokerUnavailable(
                f"{what} kept failing for {timeout_s:.0f}s: the cluster at "
                f"{self.config.kafka.bootstrap_servers} does not answer; nothing was committed "
                "past the published outputs, so a restart resumes where they end"
            )

    def _update_lag_metrics(self) -> None:
        now = time.monotonic()
        if now - self._last_lag_update >= _LAG_METRIC_INTERVAL_S:
            assert self._consumer is not None and self._committer is not None
            self._last_lag_update = now
            update_lag(self.metrics, self._consumer, self._committer.committed)
            self.metrics.queue_depth.labels("embed").set(self._embed_q.qsize())
            self.metrics.queue_depth.labels("write").set(self._write_q.qsize())

    # -- rebalances and positions ---------------------------------------------------

    def _apply_rebalance(self, polled: dict[Any, list[Any]]) -> dict[Any, list[Any]]:
        """After each poll: whatever the group (or a lost publish race) changed.
        Returns what the poll returned, less the records of every changed partition:
        they were fetched from where kafka-python put the partition (the group's
        commit, or the old position), not from where it now starts, and are fetched
        again from there."""
        assert self._reader is not None and self._committer is not None
        applied: Applied = self._reader.apply()
        if not applied.changed:
            return polled
        self.batcher.drop(applied.changed)
        self._committer.forget(applied.changed - set(applied.started))
        self.dead_letters.started(applied.started, self._reader.epoch)
        for key, offset in applied.started.items():
            self.batcher.start(key, offset)
        for key, offset in applied.commit_to.items():
            # The outputs already hold everything below: let the commit say so.
            self._committer.add_position(key, offset, self._reader.epoch(key))
        for change in applied.changes:
            self.metrics.rebalances.labels(change).inc()
        return applied.unchanged(polled)

    def _out_of_range(self, offsets: dict[TopicPartition, int]) -> None:
        """Partitions whose position Kafka no longer has: restarted at their earliest
        retained offset (consumers.repair.after_retention says why, or refuses)."""
        assert self._reader is not None
        restarts = repair.after_retention(self.config, offsets)
        if restarts:
            # The open batch must not stretch its range over the deleted offsets.
            batch = self.batcher.flush(CloseReason.SHUTDOWN)
            while batch is not None:  # with tiers, one open batch per tier
                self._hand_off(batch)
                batch = self.batcher.flush(CloseReason.SHUTDOWN)
        for key, offset in restarts.items():
            self._reader.restart_at(key, offset)
            self.batcher.start(key, offset)

    # -- bulk mode -----------------------------------------------------------------

    def _reached_end(self) -> bool:
        assert self._committer is not None and self._reader is not None
        assert self._bulk is not None
        if len(self.in_flight) or self.batcher.is_open or self._done_q.qsize():
            return False
        if self._committer.has_pending:
            return False
        next_offsets = {key: state.next_offset for key, state in self._reader.states.items()}
        return self._bulk.reached(self._admin, next_offsets)

    # -- shutdown ------------------------------------------------------------------

    def _drain(self, timeout_s: float) -> None:
        """Hands off the open batch and waits (bounded) for everything to be committed."""
        self._finish_pending()
        batch = self.batcher.flush(CloseReason.SHUTDOWN)
        while batch is not None:  # with tiers, one open batch per tier
            self._hand_off(batch)
            batch = self.batcher.flush(CloseReason.SHUTDOWN)
        deadline = time.monotonic() + timeout_s
        assert self._consumer is not None and self._reader is not None
        while len(self.in_flight) or not self._done_q.empty():
            check_stages(self._stages, self._stop_stages)
            if time.monotonic() > deadline:
                log.warning(
                    "shutdown: %d batch(es) still in flight after %.0fs; dropping them uncommitted",
                    len(self.in_flight),
                    timeout_s,
                )
                break
            # Keep the membership alive while the last batches finish.
            self._reader.set_paused(True)
            self._apply_rebalance(self._poll(50))
            self._collect_published()
        self._collect_published()
        self._flush_commits(max(1.0, deadline - time.monotonic()))

    def _commit_published(self) -> None:
        """On a failure, still commits the batches that were fully published before it."""
        try:
            self._collect_published()
            self._flush_commits(_FAILURE_COMMIT_WAIT_S)
        except PipelineError as exc:  # the failure being raised matters more than this commit
            log.warning("committing published batches after the failure: %s", exc)

    def _close(self) -> None:
        self._stop_stages.set()
        if self._tokenizer is not None:
            self._tokenizer.close()
        for stage in self._stages:
            stage.join(timeout=30)
        # Stopped stages finish nothing more: a revocation must not wait for them.
        self.in_flight.clear()
        if self._consumer is not None:
            try:
                self._consumer.close(autocommit=False, timeout_ms=10_000)
            except Exception as exc:  # closing is best effort: outputs are already safe
                log.warning("closing the consumer: %s", exc)
            if self._reader is not None:
                self._reader.rebalances.closed(self.ownership.events())
        self.dead_letter.close()
        if self.cache is not None:
            self.cache.close()
            self.summary.cache = self.cache.stats.summary(self.cache.remote is not None)
        if self._bulk is not None:
            self._bulk.close()
        if not any(stage.error for stage in self._stages):
            derived.catch_up(self.index, self.view, self.metrics, starting=False)
        engine_cpu_s = self.embedder.engine_cpu_seconds() if hasattr(self, "embedder") else 0.0
        self.summary.time_spent = time_spent(
            self.metrics, self.summary.cpu_at_first_record, engine_cpu_s
        )


def _take_all(source: queue.Queue[T]) -> Iterator[T]:
    """What a queue holds now, without waiting."""
    while True:
        try:
            yield source.get_nowait()
        except queue.Empty:
            return


def run_worker(
    config: WorkerConfig,
    model: Embedder | Future[Embedder],
    shutdown: threading.Event,
    metrics: WorkerMetrics | None = None,
) -> RunSummary:
    """Runs a worker; `model` may still be loading (a future) when it starts."""
    return Worker(config, model, shutdown, metrics).run()
