"""The two stages behind the poll loop, each on its own thread:

    poll loop --(closed batches)--> EmbedStage --(vectors)--> WriteStage --> done queue

Queues are bounded and every blocking call has a timeout, so a stage notices
the shutdown event within a fraction of a second. A stage that fails records
the error and stops; the poll loop sees it and exits without committing the
batch that failed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby
from operator import attrgetter
from pathlib import Path

import numpy as np

from consumers.batcher import MicroBatch, TopicPartitionKey
from consumers.committer import PublishedBatch
from consumers.dead_letters import DeadLetterLedger, Plan
from consumers.partitions import InFlight, Ownership
from pipeline.core import failpoints
from pipeline.core.chunks import later_chunk
from pipeline.core.config import WorkerConfig
from pipeline.core.documents import Deletion, Keyed
from pipeline.core.errors import PipelineError
from pipeline.core.host import release_free_memory
from pipeline.core.layout import SegmentKey, is_local
from pipeline.core.metrics import WorkerMetrics
from pipeline.core.records import GoodRecord
from pipeline.model.cache import EmbeddingCache, embed_cached
from pipeline.model.embedder import Embedder, EmbedStats
from sinks.compact_process import compact_in_child
from sinks.index.store import IndexStore
from sinks.parquet import ParquetSink, StagedFile
from sinks.view import ViewStore

log = logging.getLogger(__name__)

_TICK_S = 0.1
# The write stage sends dead letters and publishes only while the group has heard this
# worker within this share of its session timeout: it stops well before the group can
# give its partitions to another (consumers.dead_letters).
LEASE = 2 / 3


@dataclass
class EmbeddedBatch:
    batch: MicroBatch
    vectors: np.ndarray
    stats: EmbedStats


class Stage(threading.Thread):
    """A daemon thread that takes items from `inbox` until stopped."""

    def __init__(self, name: str, inbox: queue.Queue, stop: threading.Event) -> None:
        super().__init__(name=name, daemon=True)
        self.inbox = inbox
        self.stop_event = stop
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                try:
                    item = self.inbox.get(timeout=_TICK_S)
                except queue.Empty:
                    self.idle()
                    continue
                self.handle(item)
        except BaseException as exc:  # handed to the poll loop (check_stages), which raises it
            self.error = exc

    def handle(self, item: object) -> None:
        raise NotImplementedError

    def idle(self) -> None:
        """Called when the inbox stayed empty for a tick."""

    def put(self, target: queue.Queue, item: object) -> bool:
        """Blocks until the item fits, or returns False on shutdown."""
        while not self.stop_event.is_set():
            try:
                target.put(item, timeout=_TICK_S)
                return True
            except queue.Full:
                continue
        return False


class EmbedStage(Stage):
    # Told of each batch embedded, with its seconds: consumers.tiers sizes backfill by it.
    on_embedded: Callable[[MicroBatch, float], None] | None = None
    # Whether a batch gives way, between its forward passes, to the batches `urgent`
    # hands out (consumers.flow: backfill to nearline); by default none does.
    yields: Callable[[MicroBatch], bool] = staticmethod(lambda batch: False)
    urgent: Callable[[], MicroBatch | None] = staticmethod(lambda: None)

    def __init__(
        self,
        inbox: queue.Queue,
        outbox: queue.Queue,
        stop: threading.Event,
        embedder: Embedder,
        metrics: WorkerMetrics,
        cache: EmbeddingCache | None = None,
        in_flight: InFlight | None = None,
    ) -> None:
        super().__init__("embed", inbox, stop)
        self.outbox = outbox
        self.embedder = embedder
        self.metrics = metrics
        self.cache = cache
        self.in_flight = in_flight

    def handle(self, item: object) -> None:
        assert isinstance(item, MicroBatch)
        tokens = item.tokenized()
        between = self._run_urgent if self.yields(item) else None
        cached = ""
        if self.cache is None:
            vectors, stats = self.embedder.embed_tokens(tokens, between_passes=between)
        else:
            # Only the texts the cache lacks reach the model, each distinct one once.
            texts = [g.text for g in item.good]
            vectors, stats, found = embed_cached(
                self.embedder, self.cache, texts, tokens, between_passes=between
            )
            cached = f", {found.hits} from the cache"
        release_free_memory()
        log.debug(
            "batch %d: %d records embedded in %.3fs (%d passes, padding efficiency %.3f%s)",
            item.number,
            len(item.good),
            stats.seconds,
            stats.forward_passes,
            stats.padding_efficiency,
            cached,
        )
        if item.good:
            self.metrics.embed_seconds.observe(stats.seconds)
            if stats.forward_passes:
                self.metrics.padding_efficiency.set(stats.padding_efficiency)
            self.metrics.batch_tokens.observe(tokens.total_tokens)
        if item.good and self.on_embedded is not None:
            self.on_embedded(item, stats.seconds)
        if self.in_flight is not None:
            self.in_flight.embedded(item.number)  # a revocation now waits for its publish
        self.put(self.outbox, EmbeddedBatch(item, vectors, stats))

    def _run_urgent(self) -> None:
        """Embeds, whole and before the batch in hand goes on, every urgent batch that
        waits. Batches of other partitions overtake it: each partition's batches
        still reach the writer in order."""
        while not self.stop_event.is_set():
            batch = self.urgent()
            if batch is None:
                return
            self.handle(batch)


class WriteStage(Stage):
    """Stages Parquet files, dead-letters bad records, publishes what is still owned."""

    def __init__(
        self,
        inbox: queue.Queue,
        done: queue.Queue,
        stop: threading.Event,
        parquet: ParquetSink,
        dead_letters: DeadLetterLedger,
        index: IndexStore,
        ownership: Ownership,
        metrics: WorkerMetrics,
        index_sync_interval_s: float,
        alive: Callable[[], bool] = lambda: True,
    ) -> None:
        super().__init__("write", inbox, stop)
        self.done = done
        self.parquet = parquet
        self.dead_letters = dead_letters
        self.index = index
        self.ownership = ownership
        self.in_flight = ownership.in_flight
        self.metrics = metrics
        self.index_sync_interval_s = index_sync_interval_s
        self.alive = alive
        self._last_sync = time.monotonic()
        self._dirty = False

    def handle(self, item: object) -> None:
        assert isinstance(item, EmbeddedBatch)
        started = time.perf_counter()
        published = self.write(item)
        seconds = time.perf_counter() - started
        self.metrics.write_seconds.observe(seconds)
        log.debug("batch %d: %d rows published in %.3fs", published.number, published.rows, seconds)
        self._dirty = self._dirty or published.rows > 0
        self.in_flight.finished(item.batch.number)
        self.put(self.done, published)
        if time.monotonic() - self._last_sync >= self.index_sync_interval_s:
            self.sync_index()

    def idle(self) -> None:
        self._read_dead_letters_ahead()
        if self._dirty and time.monotonic() - self._last_sync >= self.index_sync_interval_s:
            self.sync_index()

    def _read_dead_letters_ahead(self) -> None:
        """While the first batch of a new ownership is still being embedded, reads what
        earlier owners dead-lettered (its write would read it first otherwise)."""
        unread = self.dead_letters.unread()
        if not unread:
            return
        with self.ownership.lock:
            owned = [key for key, epoch in unread.items() if self.ownership.owns(key, epoch)]
        if owned:
            self.dead_letters.read_ahead(owned)

    def sync_index(self) -> None:
        added = self.index.sync()
        self._last_sync = time.monotonic()
        self._dirty = False
        if self.index.meta is not None:
            self.metrics.index_vectors.set(self.index.meta.count)
        if added:
            stats = self.index.last_sync
            log.debug(
                "index: %d vectors added in %.3fs (%d shard(s) written, %d merged, %d bytes)",
                added,
                stats.seconds,
                stats.shards_written,
                stats.shards_merged,
                stats.bytes_written,
            )

    def write(self, embedded: EmbeddedBatch) -> PublishedBatch:
        batch = embedded.batch
        owned = self._owned(batch, set(batch.ranges))
        # What earlier owners already dead-lettered is read first (once an ownership),
        # and each segment records where the dead letters past it will lie.
        plans = self.dead_letters.prepare(
            batch.bad, {k: (batch.epochs[k], *batch.ranges[k]) for k in owned}
        )
        staged = self._stage(batch, embedded.vectors, plans)
        publish = self._send_and_publish(batch, plans, staged)
        dropped = set(batch.ranges) - publish
        if dropped:
            log.info(
                "batch %d: dropped partitions %s (no longer owned)", batch.number, sorted(dropped)
            )
        rows = sum(f.rows for f in staged if f.key.partition_key in publish)
        dead = sum(1 for b in batch.bad if _key(b) in publish)
        chunks = [g for g in batch.good if later_chunk(g)]
        return PublishedBatch(
            number=batch.number,
            next_offsets={key: batch.ranges[key][1] + 1 for key in publish},
            epochs={key: batch.epochs[key] for key in publish},
            rows=rows,
            dead_lettered=dead,
            later_chunks=sum(1 for g in chunks if _key(g) in publish),
            dropped_partitions=dropped,
            opened_at=batch.opened_at,
        )

    def _send_and_publish(
        self, batch: MicroBatch, plans: dict[TopicPartitionKey, Plan], staged: list[StagedFile]
    ) -> set[TopicPartitionKey]:
        """Dead letters, then the segments, of the partitions this worker still owns
        while the group hears it; returns the partitions published."""
        while True:
            heard = self._wait_until_heard(batch, set(plans))
            with self.ownership.lock:
                # Ownership may have changed meanwhile; this check, the dead letters and
                # the publishes are atomic with respect to revoke().
                keys = {k for k in plans if heard and self.ownership.owns(k, batch.epochs[k])}
                if keys and not self.alive():
                    continue  # the lease ran out while this waited for the lock
                # Dead letters first: once the files are published the offsets may be
                # committed, and a bad record must be durable in its topic before that.
                self.dead_letters.send(plans, keys)
                failpoints.pause("write.after_dead_letters")
                return self._publish(batch, staged, keys)

    def _publish(
        self, batch: MicroBatch, staged: list[StagedFile], keys: set[TopicPartitionKey]
    ) -> set[TopicPartitionKey]:
        publish: set[TopicPartitionKey] = set()
        for file in staged:
            key = file.key.partition_key
            if key not in keys:
                self.parquet.discard(file)
            elif self.parquet.publish(file):
                publish.add(key)
                self.dead_letters.published(key, batch.epochs[key], file.last)
            else:
                self._lost_race(batch, file)
        return publish

    def _owned(self, batch: MicroBatch, keys: set[TopicPartitionKey]) -> set[TopicPartitionKey]:
        with self.ownership.lock:
            return {key for key in keys if self.ownership.owns(key, batch.epochs[key])}

    def _wait_until_heard(self, batch: MicroBatch, owned: set[TopicPartitionKey]) -> bool:
        """Holds publication while the group may have dropped this worker.

        A worker that stalled past its session timeout (SIGSTOP, a long GC, a
        frozen VM) wakes up still believing it owns its partitions. Until a
        heartbeat gets through again, or the partitions are taken away, its
        publishes wait. (The create-if-absent publish makes a late publish
        harmless anyway; this keeps it from even trying.)
        """
        while not self.alive():
            if self.stop_event.is_set() or not self._owned(batch, owned):
                return False
            time.sleep(_TICK_S)
        return True

    def _lost_race(self, batch: MicroBatch, file: StagedFile) -> None:
        key = file.key.partition_key
        log.warning(
            "batch %d: %s[%d] from offset %d was published by another worker first; "
            "reading the partition again from where the outputs end",
            batch.number,
            key[0],
            key[1],
            file.key.first,
        )
        self.metrics.publish_conflicts.inc()
        self.ownership.fence(key, batch.epochs[key])

    def _stage(
        self, batch: MicroBatch, vectors: np.ndarray, plans: dict[TopicPartitionKey, Plan]
    ) -> list[StagedFile]:
        """The segments of the partitions planned (the others are not owned any more).
        A batch holds runs of one partition's records (a poll's, in order): grouped a run
        at a time, without a Python call a record."""
        keys = list(map(_key, batch.good))
        by_partition: dict[TopicPartitionKey, list[int]] = defaultdict(list)
        for key, run in groupby(range(len(keys)), keys.__getitem__):
            by_partition[key].extend(run)
        bad = Counter(map(_key, batch.bad))
        deleted: dict[TopicPartitionKey, list[Deletion]] = defaultdict(list)
        for deletion in batch.deleted:
            deleted[_key(deletion)].append(deletion)
        staged = []
        for key, (first, last) in sorted(batch.ranges.items()):
            if key not in plans:
                continue
            rows = by_partition.get(key, [])
            records: list[GoodRecord] = list(map(batch.good.__getitem__, rows))
            staged.append(
                self.parquet.stage(
                    SegmentKey(key[0], key[1], first),
                    last,
                    records,
                    vectors[rows],
                    consumed=_records(records) + len(deleted.get(key, ())) + bad.get(key, 0),
                    start=batch.start_notes.get(key),
                    dead_letters=plans[key].mark,
                    deletions=deleted.get(key, ()),
                    tokens=[len(batch.token_ids[i]) for i in rows],
                )
            )
        return staged


def _records(rows: list[GoodRecord]) -> int:
    """The records `rows` are of: a chunked record's chunks count once."""
    return sum(not later_chunk(row) for row in rows)


# A record's (topic, partition); an attrgetter, so that map() needs no Python call.
_key: Callable[[Keyed], TopicPartitionKey] = attrgetter("source.topic", "source.partition")


class PeriodicStage(Stage):
    """A stage that queues nothing and does its upkeep (`tick`) every `interval_s`."""

    def __init__(self, name: str, stop: threading.Event, interval_s: float) -> None:
        super().__init__(name, queue.Queue(maxsize=1), stop)
        self.interval_s = interval_s
        self._last = time.monotonic()

    def handle(self, item: object) -> None:  # nothing is ever queued here
        raise AssertionError(f"unexpected item {item!r}")

    def idle(self) -> None:
        if time.monotonic() - self._last < self.interval_s:
            return
        self._last = time.monotonic()
        self.tick()

    def tick(self) -> None:
        raise NotImplementedError


class CompactStage(PeriodicStage):
    """Merges small segments every `interval_s` (sinks.compaction), off the hot path:
    in a child process (sinks.compact_process), so that neither its CPU work nor its
    buffers stay with the worker.

    Compaction is upkeep: when it cannot run (another worker is compacting, the
    filesystem cannot exchange directories, the disk is full) the worker goes on
    without it and says why, once.
    """

    def __init__(
        self,
        output: Path,
        stop: threading.Event,
        interval_s: float,
        target_bytes: int,
        purge: bool = False,
    ) -> None:
        """`purge`: each compaction also erases superseded and deleted documents
        (upsert mode: sinks.purge)."""
        super().__init__("compact", stop, interval_s)
        self.purge = purge
        self.output = output
        self.target_bytes = target_bytes
        self._warned: set[str] = set()

    def tick(self) -> None:
        try:
            report = compact_in_child(
                self.output, self.target_bytes, self.stop_event, purge=self.purge
            )
        except PipelineError as exc:
            if str(exc) not in self._warned:
                self._warned.add(str(exc))
                log.warning("compaction skipped: %s", exc)
            return
        if report is not None and report.runs:
            log.info(
                "compaction: %d segments merged into %d (%d rows) in %.1fs",
                report.merged_files,
                report.runs,
                report.rows,
                report.seconds,
            )


class ViewStage(PeriodicStage):
    """Applies published segments to the current view every `interval_s` (upsert mode:
    sinks.view), off the write path, so that a slow apply never holds a publish."""

    def __init__(
        self,
        view: ViewStore,
        stop: threading.Event,
        interval_s: float,
        upkeep_s: float,
        metrics: WorkerMetrics,
    ) -> None:
        """`upkeep_s`: how often the view's files are compacted and its old versions
        removed (sinks.view: maintain); 0: never."""
        super().__init__("view", stop, interval_s)
        self.view = view
        self.metrics = metrics
        self.upkeep_s = upkeep_s
        self._upkept = time.monotonic()

    def tick(self) -> None:
        if self.upkeep_s and time.monotonic() - self._upkept >= self.upkeep_s:
            self._upkept = time.monotonic()
            started = time.perf_counter()
            if self.view.maintain():
                log.info(
                    "view: compacted, old versions removed in %.1fs", time.perf_counter() - started
                )
        if self.view.sync():
            stats = self.view.last_sync
            self.metrics.view_apply_seconds.observe(stats.seconds / max(1, stats.commits))
            self.metrics.view_changes.labels("upserted").inc(stats.upserted)
            self.metrics.view_changes.labels("deleted").inc(stats.deleted)
            log.debug(
                "view: %d rows applied (%d upserted, %d deleted) in %d commit(s), %.3fs",
                stats.applied_rows,
                stats.upserted,
                stats.deleted,
                stats.commits,
                stats.seconds,
            )


def start_stages(
    config: WorkerConfig,
    embedder: Embedder,
    cache: EmbeddingCache | None,
    parquet: ParquetSink,
    dead_letters: DeadLetterLedger,
    index: IndexStore,
    ownership: Ownership,
    metrics: WorkerMetrics,
    queues: tuple[queue.Queue, queue.Queue, queue.Queue],
    stop: threading.Event,
    heard_within: Callable[[float], bool],
    view: ViewStore | None = None,
) -> list[Stage]:
    """The embed and write stages (and compaction's, on a local output), started;
    `queues`: the embed stage's inbox, the write stage's, and the published batches;
    `heard_within(s)`: whether the group heard this worker within s seconds."""
    embed_q, write_q, done_q = queues
    embed = EmbedStage(embed_q, write_q, stop, embedder, metrics, cache, ownership.in_flight)
    lease_s = config.liveness.session_timeout_ms / 1000 * LEASE
    write = WriteStage(
        write_q, done_q, stop, parquet, dead_letters, index, ownership, metrics,
        config.storage.index_sync_interval_s, alive=lambda: heard_within(lease_s),
    )  # fmt: skip
    stages: list[Stage] = [embed, write]
    if view is not None:
        storage = config.storage
        upkeep = storage.compact_interval_s
        stages.append(ViewStage(view, stop, storage.view_sync_interval_s, upkeep, metrics))
    if config.storage.compact_interval_s > 0 and not is_local(config.output):
        log.info("compaction: off, as the output is on an object store (not supported yet)")
    elif config.storage.compact_interval_s > 0:
        interval, target = config.storage.compact_interval_s, config.storage.compact_target_mb << 20
        purge = config.storage.compact_purge
        stages.append(CompactStage(config.output, stop, interval, target, purge))
    for stage in stages:
        stage.start()
    return stages


def check_stages(stages: list[Stage], stopping: threading.Event) -> None:
    """Raises the first stage's failure in the poll loop, as it was: an expected one
    (a PipelineError) stays one line, anything else is a bug and keeps the stage
    thread's traceback."""
    for stage in stages:
        if stage.error is not None:
            raise stage.error
        if not stage.is_alive() and not stopping.is_set():
            raise PipelineError(f"the {stage.name} stage stopped unexpectedly")
