"""The worker: poll, parse, tokenize and batch on this thread; embed and write on
two stage threads; commit back on this thread (the consumer is not thread-safe).

Backpressure: at most `max_in_flight` batches are between poll and commit.
When that many are out, every owned partition is paused and `poll()` keeps
being called (it returns nothing for paused partitions), so the worker stays in
its group however slow a batch is, and memory stays bounded by the batches in
flight plus the consumer's fetch buffers, whatever the backlog.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, TypeVar

from kafka import ConsumerRebalanceListener, KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from consumers.committer import OffsetCommitter, Ownership, PublishedBatch
from consumers.stages import EmbedStage, InFlight, Stage, WriteStage
from pipeline import cluster
from pipeline.batcher import Batcher, CloseReason, MicroBatch, TopicPartitionKey
from pipeline.config import WorkerConfig
from pipeline.embedder import Embedder
from pipeline.errors import PipelineError
from pipeline.metrics import WorkerMetrics
from pipeline.progress import Progress
from pipeline.records import GoodRecord, RecordParser, SourceRecord
from sinks.dead_letter import DeadLetterSink
from sinks.faiss_index import IndexStore
from sinks.layout import written_high_offsets
from sinks.parquet import ParquetSink

log = logging.getLogger(__name__)
T = TypeVar("T")

_POLL_TICK_MS = 100
_END_CHECK_INTERVAL_S = 1.0
_END_CHECK_IDLE_S = 0.2  # nothing in flight: the end may just have been reached
_LAG_METRIC_INTERVAL_S = 2.0


class RunSummary:
    """What a run did. The rate counts from the first record polled to the last
    commit: processing throughput, without start-up (model load, group join)."""

    def __init__(self) -> None:
        self.records = 0
        self.rows = 0
        self.dead_lettered = 0
        self.batches = 0
        self.started = time.monotonic()
        self.first_record_at: float | None = None
        self.last_commit_at: float | None = None

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    @property
    def processing_seconds(self) -> float:
        if self.first_record_at is None or self.last_commit_at is None:
            return 0.0
        return self.last_commit_at - self.first_record_at

    def __str__(self) -> str:
        busy = self.processing_seconds
        rate = self.records / busy if busy > 0 else 0.0
        return (
            f"{self.records} records ({self.rows} embedded, {self.dead_lettered} dead-lettered) "
            f"in {self.batches} batches, {busy:.1f}s, {rate:,.0f} records/s "
            f"(first record to last commit; {self.seconds:.1f}s in all)"
        )


class _Listener(ConsumerRebalanceListener):
    """Runs on kafka-python's IO thread: only bounded waits and state changes here."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def on_partitions_revoked(self, revoked: Any) -> None:
        self.worker.partitions_revoked({(tp.topic, tp.partition) for tp in revoked}, lost=False)

    def on_partitions_lost(self, lost: Any) -> None:
        self.worker.partitions_revoked({(tp.topic, tp.partition) for tp in lost}, lost=True)

    def on_partitions_assigned(self, assigned: Any) -> None:
        self.worker.partitions_assigned(list(assigned))


class Worker:
    def __init__(
        self,
        config: WorkerConfig,
        embedder: Embedder,
        shutdown: threading.Event,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.config = config
        self.embedder = embedder
        self.shutdown = shutdown
        self.metrics = metrics or WorkerMetrics()
        self.summary = RunSummary()
        self.ownership = Ownership()
        self.in_flight = InFlight(self.ownership)
        self.parser = RecordParser(config.text_field, config.id_field, config.max_text_bytes)
        self.batcher = Batcher(
            config.batch_size, config.max_batch_tokens, config.poll_timeout_ms / 1000
        )
        self.parquet = ParquetSink(config.output, embedder.info)
        self.index = IndexStore(config.output, use_gpu=embedder.info.device == "cuda")
        self.dead_letter = DeadLetterSink(config.kafka, config.dead_letter_topic)
        self._stop_stages = threading.Event()
        self._embed_q: queue.Queue[MicroBatch] = queue.Queue(maxsize=config.max_in_flight + 1)
        self._write_q: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._done_q: queue.Queue[PublishedBatch] = queue.Queue()
        self._revoked_q: queue.Queue[set[TopicPartitionKey]] = queue.Queue()
        self._assigned_positions: queue.Queue[dict[TopicPartitionKey, tuple[int, int]]] = (
            queue.Queue()
        )
        self._paused: set[TopicPartition] = set()
        self._consumer: KafkaConsumer | None = None
        self._committer: OffsetCommitter | None = None
        self._stages: list[Stage] = []
        self._end_targets: dict[TopicPartition, int] = {}
        self._progress: Progress | None = None
        self._last_lag_update = 0.0
        self._admin: Any = None
        # The revoke wait runs on kafka-python's IO thread and holds up heartbeats:
        # keep it well inside both the session timeout and the rebalance timeout.
        self._revoke_timeout_s = min(
            config.revoke_timeout_s,
            config.session_timeout_ms / 2000,
            config.max_poll_interval_ms / 2000,
        )

    # -- life cycle ----------------------------------------------------------------

    def run(self) -> RunSummary:
        """Runs until the end (bulk mode), a signal, or an error; returns a summary."""
        with contextlib.ExitStack() as resources:
            self._admin = resources.enter_context(cluster.admin_client(self.config.kafka))
            return self._run()

    def _run(self) -> RunSummary:
        self._preflight()
        removed = self.parquet.prepare()
        if removed:
            log.info("removed %d temp file(s) left by dead writers", removed)
        caught_up = self.index.sync()
        if caught_up:
            log.info("index caught up with %d vectors from existing Parquet files", caught_up)
        self._consumer = self._make_consumer()
        self._committer = OffsetCommitter(self._consumer, self.ownership)
        self._start_stages()
        try:
            self._loop()
            self._drain(self.config.shutdown_timeout_s)
        except PipelineError:
            self._commit_published()
            raise
        finally:
            self._close()
        return self.summary

    def _preflight(self) -> None:
        cfg = self.config
        partitions = cluster.partitions_of(self._admin, cfg.topics)
        cluster.ensure_topic(self._admin, cfg.dead_letter_topic)
        if cfg.until_end:
            with cluster.offsets_consumer(cfg.kafka) as reader:
                self._end_targets = cluster.end_offsets(reader, partitions)
            remaining = self._group_remaining(cluster.group_offsets(self._admin, cfg.group))
            log.info(
                "bulk mode: %d records to the end of %d partition(s)", remaining, len(partitions)
            )
            self._progress = Progress("embedding", remaining, enabled=cfg.progress)

    def _group_remaining(self, committed: dict[TopicPartition, int]) -> int:
        return sum(max(0, end - committed.get(tp, 0)) for tp, end in self._end_targets.items())

    def _make_consumer(self) -> KafkaConsumer:
        cfg = self.config
        try:
            consumer = KafkaConsumer(
                group_id=cfg.group,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                max_poll_records=cfg.batch_size,
                max_poll_interval_ms=cfg.max_poll_interval_ms,
                session_timeout_ms=cfg.session_timeout_ms,
                # Bounds the fetch buffers: part of the worker's memory ceiling.
                fetch_max_bytes=16 * 1024 * 1024,
                max_partition_fetch_bytes=2 * 1024 * 1024,
                bootstrap_timeout_ms=cluster.BOOTSTRAP_TIMEOUT_MS,
                **cfg.kafka.client_kwargs(),
            )
        except KafkaError as exc:
            raise cluster.unreachable(cfg.kafka, exc) from exc
        consumer.subscribe(list(cfg.topics), listener=_Listener(self))
        # A metadata refresh before the first poll: kafka-python snapshots the
        # subscribed topics' partitions on metadata updates, and a first join with
        # an empty snapshot is followed by a needless second rebalance.
        consumer.topics()
        return consumer

    def _start_stages(self) -> None:
        embed = EmbedStage(
            self._embed_q, self._write_q, self._stop_stages, self.embedder, self.metrics
        )
        write = WriteStage(
            self._write_q,
            self._done_q,
            self._stop_stages,
            self.parquet,
            self.dead_letter,
            self.index,
            self.ownership,
            self.in_flight,
            self.metrics,
            self.config.index_sync_interval_s,
        )
        self._stages = [embed, write]
        for stage in self._stages:
            stage.start()

    # -- the poll loop -------------------------------------------------------------

    def _loop(self) -> None:
        assert self._consumer is not None
        last_end_check = 0.0
        while not self.shutdown.is_set():
            self._check_stages()
            self._apply_rebalance_effects()
            self._collect_published()
            self._flow_control()
            timeout = self._poll_timeout_ms()
            polled = self._consumer.poll(timeout_ms=timeout)
            if polled:
                if self.summary.first_record_at is None:
                    self.summary.first_record_at = time.monotonic()
                self._ingest(polled)
            if self.batcher.pending and self._caught_up(empty_poll=not polled, timeout=timeout):
                # The open batch holds all there is to read for now: waiting for
                # it to fill would only add latency.
                batch = self.batcher.flush(CloseReason.CAUGHT_UP)
                assert batch is not None
                self._hand_off(batch)
            due = self.batcher.due()
            if due is not None:
                self._hand_off(due)
            self._update_lag_metrics()
            idle = not len(self.in_flight) and not self.batcher.pending
            check_every = _END_CHECK_IDLE_S if idle else _END_CHECK_INTERVAL_S
            if self.config.until_end and time.monotonic() - last_end_check > check_every:
                last_end_check = time.monotonic()
                if self._reached_end():
                    log.info("bulk mode: the group's committed offsets reached the end")
                    return
        log.info("shutdown requested: finishing the batches in flight")

    def _caught_up(self, empty_poll: bool, timeout: int) -> bool:
        """Whether every partition read here has nothing more to fetch right now.

        Either a full-length poll came back empty, or each partition's position
        has reached its high watermark (known once a fetch for it returned).
        Paused partitions may hold more, so nothing is caught up while any is.
        """
        assert self._consumer is not None
        if self._paused:
            return False
        if empty_poll:
            return timeout >= _POLL_TICK_MS
        assignment = self._consumer.assignment()
        if not assignment:
            return False
        for tp in assignment:
            highwater = self._consumer.highwater(tp)
            if highwater is None:
                return False
            try:
                # Known positions are answered locally; an unknown one is not waited for.
                position = self._consumer.position(tp, timeout_ms=0)
            except KafkaError:
                return False
            if position is None or position < highwater:
                return False
        return True

    def _poll_timeout_ms(self) -> int:
        until_due = self.batcher.seconds_until_due()
        if until_due is None:
            return _POLL_TICK_MS
        return max(0, min(_POLL_TICK_MS, int(until_due * 1000)))

    def _ingest(self, polled: dict[Any, list[Any]]) -> None:
        sources = [
            SourceRecord(r.topic, r.partition, r.offset, r.timestamp, r.key, r.value)
            for records in polled.values()
            for r in records
        ]
        parsed = [self.parser.parse(s) for s in sources]
        good = [p for p in parsed if isinstance(p, GoodRecord)]
        tokens = self.embedder.tokenize([g.text for g in good])
        if tokens.truncated:
            self.metrics.truncated.inc(tokens.truncated)
        ids = iter(tokens.ids)
        pairs = [(p, next(ids) if isinstance(p, GoodRecord) else None) for p in parsed]
        for batch in self.batcher.add(pairs, self.ownership.epoch):
            self._hand_off(batch)

    def _hand_off(self, batch: MicroBatch) -> None:
        # Drop what was polled under an assignment that has since changed.
        stale = {k for k, e in batch.epochs.items() if self.ownership.epoch(k) != e}
        if stale:
            batch = batch.without(stale)
        if not len(batch):
            return
        self.in_flight.started(batch)
        reason = batch.closed_by.value if batch.closed_by else "unknown"
        log.debug("batch %d: closed (%s) with %d records", batch.number, reason, len(batch))
        self.metrics.batches_closed.labels(reason).inc()
        self.metrics.in_flight.set(len(self.in_flight))
        self.metrics.batch_records.observe(len(batch))
        while True:
            try:
                self._embed_q.put(batch, timeout=0.1)
                return
            except queue.Full:
                self._check_stages()

    def _flow_control(self) -> None:
        assert self._consumer is not None
        full = len(self.in_flight) >= self.config.max_in_flight
        assigned = set(self._consumer.assignment())
        if full:
            to_pause = assigned - self._paused
            if to_pause:
                self._consumer.pause(*to_pause)
                self._paused |= to_pause
        elif self._paused:
            to_resume = self._paused & assigned
            if to_resume:
                self._consumer.resume(*to_resume)
            self._paused = set()
        self.metrics.paused.set(len(self._paused))

    def _collect_published(self) -> None:
        assert self._committer is not None
        opened: list[float] = []
        for published in _take_all(self._done_q):
            self._committer.add(published)
            self._account(published)
            opened.append(published.opened_at)
        if self._committer.has_pending:
            started = time.perf_counter()
            if self._committer.commit():
                self.metrics.commit_seconds.observe(time.perf_counter() - started)
                now = time.monotonic()
                self.summary.last_commit_at = now
                for opened_at in opened:
                    self.metrics.batch_latency.observe(now - opened_at)
        self.metrics.in_flight.set(len(self.in_flight))

    def _account(self, published: PublishedBatch) -> None:
        records = published.rows + published.dead_lettered
        self.summary.records += records
        self.summary.rows += published.rows
        self.summary.dead_lettered += published.dead_lettered
        self.summary.batches += 1
        self.metrics.records.labels("embedded").inc(published.rows)
        self.metrics.records.labels("dead_lettered").inc(published.dead_lettered)
        self.metrics.dead_letter.inc(published.dead_lettered)
        self.metrics.batches.inc()

    def _update_lag_metrics(self) -> None:
        """Lag per owned partition: high watermark (from fetches) minus committed offset."""
        now = time.monotonic()
        if now - self._last_lag_update < _LAG_METRIC_INTERVAL_S:
            return
        self._last_lag_update = now
        assert self._consumer is not None and self._committer is not None
        for tp in self._consumer.assignment():
            highwater = self._consumer.highwater(tp)
            committed = self._committer.committed.get((tp.topic, tp.partition))
            if highwater is not None and committed is not None:
                self.metrics.lag.labels(tp.topic, str(tp.partition)).set(highwater - committed)

    def _check_stages(self) -> None:
        for stage in self._stages:
            if stage.error is not None:
                error = stage.error
                if isinstance(error, PipelineError):
                    raise error
                raise PipelineError(f"the {stage.name} stage failed: {error!r}") from error
            if not stage.is_alive() and not self._stop_stages.is_set():
                raise PipelineError(f"the {stage.name} stage stopped unexpectedly")

    # -- rebalances (called on kafka-python's IO thread) ------------------------------

    def partitions_revoked(self, keys: set[TopicPartitionKey], lost: bool) -> None:
        # Give in-flight work on these partitions a bounded time to be published:
        # once published, the next owner starts past it. After the wait, what is
        # still in flight is dropped, never committed.
        if not lost and keys and not self.in_flight.wait_for(keys, self._revoke_timeout_s):
            log.warning(
                "revoke: batches on %s not published within %.0fs; dropping them",
                sorted(keys),
                self._revoke_timeout_s,
            )
        self.ownership.revoke(keys)
        self._revoked_q.put(keys)
        log.info("partitions %s: %s", "lost" if lost else "revoked", sorted(keys))

    def partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        keys = [(tp.topic, tp.partition) for tp in assigned]
        self.ownership.assign(keys)
        # Start past what the output directory already holds (a crash between
        # publish and commit, or another worker's last batch before a rebalance).
        written = written_high_offsets(self.config.output)
        positions = {}
        assert self._consumer is not None
        for tp in assigned:
            key = (tp.topic, tp.partition)
            if key in written:
                self._consumer.seek(tp, written[key] + 1)
                positions[key] = (written[key] + 1, self.ownership.epoch(key))
        self._paused -= set(assigned)
        self._assigned_positions.put(positions)
        log.info(
            "partitions assigned: %s%s",
            sorted(keys),
            f" (resuming past written files: {positions})" if positions else "",
        )

    def _apply_rebalance_effects(self) -> None:
        assert self._committer is not None
        for revoked in _take_all(self._revoked_q):
            self.batcher.drop(revoked)
        for positions in _take_all(self._assigned_positions):
            for key, (offset, epoch) in positions.items():
                self._committer.add_position(key, offset, epoch)

    # -- bulk mode -----------------------------------------------------------------

    def _reached_end(self) -> bool:
        if len(self.in_flight) or self.batcher.pending or self._done_q.qsize():
            self._group_committed()
            return False
        assert self._committer is not None
        if self._committer.has_pending:
            return False
        return self._group_remaining(self._group_committed()) == 0

    def _group_committed(self) -> dict[TopicPartition, int]:
        """The whole group's commits (any worker's), which also drive the progress bar."""
        committed = cluster.group_offsets(self._admin, self.config.group)
        if self._progress is not None and self._progress.total is not None:
            # The bar's total is what remained at start.
            self._progress.update(self._progress.total - self._group_remaining(committed))
        return committed

    # -- shutdown ------------------------------------------------------------------

    def _drain(self, timeout_s: float) -> None:
        """Hands off the open batch and waits (bounded) for everything to be committed."""
        batch = self.batcher.flush(CloseReason.SHUTDOWN)
        if batch is not None:
            self._hand_off(batch)
        deadline = time.monotonic() + timeout_s
        assert self._consumer is not None
        while len(self.in_flight) or not self._done_q.empty():
            self._check_stages()
            if time.monotonic() > deadline:
                log.warning(
                    "shutdown: %d batch(es) still in flight after %.0fs; dropping them uncommitted",
                    len(self.in_flight),
                    timeout_s,
                )
                break
            # Keep the membership alive while the last batches finish.
            self._pause_all()
            self._consumer.poll(timeout_ms=50)
            self._apply_rebalance_effects()
            self._collect_published()
        self._collect_published()

    def _pause_all(self) -> None:
        assert self._consumer is not None
        assignment = set(self._consumer.assignment())
        if assignment - self._paused:
            self._consumer.pause(*(assignment - self._paused))
            self._paused |= assignment

    def _commit_published(self) -> None:
        """On a failure, still commits the batches that were fully published before it."""
        try:
            self._collect_published()
        except Exception as exc:  # the failure being raised matters more than this commit
            log.warning("committing published batches after the failure: %s", exc)

    def _close(self) -> None:
        self._stop_stages.set()
        for stage in self._stages:
            stage.join(timeout=30)
        # Stopped stages finish nothing more: a revocation must not wait for them.
        self.in_flight.clear()
        if self._consumer is not None:
            try:
                self._consumer.close(autocommit=False, timeout_ms=10_000)
            except Exception as exc:  # closing is best effort: outputs are already safe
                log.warning("closing the consumer: %s", exc)
        self.dead_letter.close()
        if self._progress is not None:
            self._progress.close()
        if not any(stage.error for stage in self._stages):
            # Every published file goes into the index before the worker exits.
            self.index.sync()
            if self.index.meta is not None:
                self.metrics.index_vectors.set(self.index.meta.count)


def _take_all(source: queue.Queue[T]) -> Iterator[T]:
    """What a queue holds now, without waiting."""
    while True:
        try:
            yield source.get_nowait()
        except queue.Empty:
            return


def run_worker(
    config: WorkerConfig,
    embedder: Embedder,
    shutdown: threading.Event,
    metrics: WorkerMetrics | None = None,
) -> RunSummary:
    return Worker(config, embedder, shutdown, metrics).run()
