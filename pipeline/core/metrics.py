"""Worker metrics, one registry per worker, served for Prometheus on --metrics-port."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_SIZE_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_TOKEN_BUCKETS = (64, 256, 1024, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288)
# High watermarks remembered per partition for its lag in seconds; past this many, every
# other one is dropped (the figure can then only come out lower, never higher).
_LAG_CLOCK_ENTRIES = 256
_PARTITION_LABELS = ["topic", "partition", "tier"]

PartitionKey = tuple[str, int]
# The tier of a partition without priority tiers (consumers.tiers.NEARLINE: anything
# not named by --backfill-topic).
DEFAULT_TIER = "nearline"


class LagClock:
    """When this worker first saw each stretch of a partition's offsets exist.

    Each observation of a higher high watermark is remembered with its time: the
    records below it were known to exist then. The oldest record not yet committed
    (the one at the committed offset) was first seen at the earliest remembered
    watermark above that offset, so its age as seen by this worker is `now` minus
    that time: a lower bound on its real age (it was produced before this worker saw
    it, and the clock of a partition starts when this worker takes it), kept by the
    worker's own monotonic clock, so producers' clocks and timestamps play no part.
    """

    def __init__(self, max_entries: int = _LAG_CLOCK_ENTRIES) -> None:
        self._max = max_entries
        self._seen: dict[PartitionKey, list[tuple[int, float]]] = {}

    def seconds(self, key: PartitionKey, highwater: int, committed: int, now: float) -> float:
        """The age of the oldest record below `highwater` from `committed` on; 0 when
        there is none."""
        seen = self._seen.setdefault(key, [])
        if not seen or highwater > seen[-1][0]:
            seen.append((highwater, now))
        while seen and seen[0][0] <= committed:
            seen.pop(0)
        if len(seen) > self._max:
            # Keeps the first and the last: a dropped watermark's records are dated by
            # the next one kept, which was seen later.
            seen[:] = [*seen[:-1:2], seen[-1]]
        return now - seen[0][1] if seen and committed < highwater else 0.0

    def forget(self, key: PartitionKey) -> None:
        self._seen.pop(key, None)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.records = Counter(
            "pipeline_records", "Records processed, by outcome", ["outcome"], registry=r
        )
        self.batches = Counter("pipeline_batches", "Micro-batches committed", registry=r)
        self.batches_closed = Counter(
            "pipeline_batches_closed",
            "Micro-batches handed to the embed stage, by what closed them "
            "(records, tokens, age, caught_up, shutdown)",
            ["reason"],
            registry=r,
        )
        self.batch_records = Histogram(
            "pipeline_batch_records", "Records per micro-batch", buckets=_SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "pipeline_batch_tokens",
            "Real tokens per micro-batch",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.padding_efficiency = Gauge(
            "pipeline_padding_efficiency",
            "Real tokens / computed tokens of the last batch (1.0 = no padding)",
            registry=r,
        )
        self.truncated = Counter(
            "pipeline_truncated_records",
            "Rows whose text the model's length (or --max-chunks) cut: search cannot see the rest",
            registry=r,
        )
        self.embed_seconds = Histogram(
            "pipeline_embed_seconds",
            "Embedding time per batch",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.write_seconds = Histogram(
            "pipeline_write_seconds",
            "Parquet + dead-letter + publish time per batch",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.commit_seconds = Histogram(
            "pipeline_commit_seconds", "Offset commit time", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.batch_latency = Histogram(
            "pipeline_batch_latency_seconds",
            "From a batch's first record polled to its offsets committed",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "pipeline_batches_in_flight", "Batches between poll and commit", registry=r
        )
        self.queue_depth = Gauge(
            "pipeline_queue_depth",
            "Closed batches waiting for a stage: embed (the model), write (the sinks)",
            ["queue"],
            registry=r,
        )
        for stage in ("embed", "write"):
            self.queue_depth.labels(stage).set(0)  # exported from the start
        self.paused = Gauge(
            "pipeline_paused_partitions", "Partitions paused by backpressure", registry=r
        )
        self.dead_letter = Counter(
            "pipeline_dead_letter_records", "Records sent to the dead-letter topic", registry=r
        )
        # Each partition's three, for the partitions this worker owns and has committed
        # since it took them (set_partition_lag), labelled with the partition's tier so
        # that alerts can tell a backfill partition waiting on purpose from a stall.
        self.lag = Gauge(
            "pipeline_partition_lag",
            "Records not yet committed: the high watermark last fetched minus the offset "
            "this worker committed",
            _PARTITION_LABELS,
            registry=r,
        )
        self.lag_seconds = Gauge(
            "pipeline_partition_lag_seconds",
            "Seconds since this worker first saw the oldest record it has not committed "
            "(its fetches' high watermark passed it); 0 when the lag is 0. A lower bound on "
            "that record's age, counted from when this worker took the partition",
            _PARTITION_LABELS,
            registry=r,
        )
        self.committed_offset = Gauge(
            "pipeline_committed_offset",
            "The offset this worker last committed (acknowledged by the broker)",
            _PARTITION_LABELS,
            registry=r,
        )
        self._lag_clock = LagClock()
        self._lag_labels: dict[PartitionKey, tuple[str, str, str]] = {}
        # A partition's tier; the tiered flow control (consumers.flow) sets its own.
        self.tier_of: Callable[[PartitionKey], str] = lambda key: DEFAULT_TIER
        self.publish_conflicts = Counter(
            "pipeline_publish_conflicts",
            "Segments another worker published first (a stalled worker coming back)",
            registry=r,
        )
        self.quarantined = Counter(
            "pipeline_quarantined_segments",
            "Damaged segments moved aside to be read again from Kafka",
            registry=r,
        )
        self.repaired = Counter(
            "pipeline_repaired_segments",
            "Damaged segments whose records were read again from Kafka and written anew",
            registry=r,
        )
        self.rebalances = Counter(
            "pipeline_rebalance_events",
            "Partition ownership changes seen by this worker, by kind",
            ["change"],
            registry=r,
        )
        self.index_vectors = Gauge(
            "pipeline_index_vectors", "Vectors in the FAISS index after the last sync", registry=r
        )
        # Upsert mode's current view (sinks.view).
        self.view_apply_seconds = Histogram(
            "pipeline_view_apply_seconds",
            "Time per apply of published segments to the current view (one commit each)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.view_changes = Counter(
            "pipeline_view_changes",
            "Changes applied to the current view, by kind",
            ["change"],
            registry=r,
        )
        # The embedding cache by content (pipeline.model.cache).
        self.cache_hits = Counter(
            "pipeline_cache_hits",
            "Records whose vector was not computed, by where it came from "
            "(batch: a repeat within the batch; lru; redis)",
            ["tier"],
            registry=r,
        )
        self.cache_misses = Counter(
            "pipeline_cache_misses", "Records the cache lacked (embedded by the model)", registry=r
        )
        self.cache_errors = Counter(
            "pipeline_cache_errors",
            "Failed calls to the shared cache, by operation (get, put, ping): the batch was "
            "embedded without it",
            ["op"],
            registry=r,
        )
        self.cache_remote_up = Gauge(
            "pipeline_cache_remote_up",
            "1 while the shared cache (Redis) answers; 0 after a failed call until one "
            "succeeds, and where there is none",
            registry=r,
        )
        self.cache_entries = Gauge(
            "pipeline_cache_entries", "Vectors held by the in-process cache", registry=r
        )
        self.cache_bytes = Gauge(
            "pipeline_cache_bytes", "Bytes held by the in-process cache (estimated)", registry=r
        )
        # Priority tiers (consumers.tiers), with --backfill-topic.
        self.backfill_waiting = Gauge(
            "pipeline_backfill_waiting",
            "1 while the backfill partitions wait for nearline lag to clear",
            registry=r,
        )
        self.backfill_pauses = Counter(
            "pipeline_backfill_pauses", "Times backfill started waiting for nearline", registry=r
        )
        self.nearline_lag = Gauge(
            "pipeline_nearline_lag",
            "Nearline records fetched or fetchable but not yet taken (high watermark - position)",
            registry=r,
        )
        self.tier_partitions = Gauge(
            "pipeline_tier_partitions",
            "Partitions this worker owns, by tier and whether they are paused",
            ["tier", "state"],
            registry=r,
        )
        self.tier_records = Counter(
            "pipeline_tier_records",
            "Records polled and taken into batches, by tier (nearline, backfill)",
            ["tier"],
            registry=r,
        )
        self.backfill_batch_records = Gauge(
            "pipeline_backfill_batch_records",
            "Records per backfill batch now (about --backfill-batch-ms of embedding)",
            registry=r,
        )

        # process_resident_memory_bytes, CPU, open files, start time; python_info.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)

    def set_partition_lag(
        self, positions: Mapping[PartitionKey, tuple[int, int]], now: float
    ) -> None:
        """Sets the lag series from (high watermark, committed offset) per partition
        (`now`: time.monotonic()); removes those of partitions not among them (no
        longer owned, or not committed since this worker took them)."""
        labels_now = {key: (key[0], str(key[1]), self.tier_of(key)) for key in positions}
        for key, labels in self._lag_labels.items():
            if labels_now.get(key) != labels:
                for gauge in (self.lag, self.lag_seconds, self.committed_offset):
                    gauge.remove(*labels)
            if key not in labels_now:
                self._lag_clock.forget(key)
        for key, (highwater, committed) in positions.items():
            labels = labels_now[key]
            self.lag.labels(*labels).set(max(0, highwater - committed))
            self.lag_seconds.labels(*labels).set(
                self._lag_clock.seconds(key, highwater, committed, now)
            )
            self.committed_offset.labels(*labels).set(committed)
        self._lag_labels = labels_now

    def serve(self, port: int) -> None:
        start_http_server(port, addr="0.0.0.0", registry=self.registry)
