"""What a worker run did, for its last line and the benchmarks that read it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from consumers.committer import PublishedBatch
from pipeline.core.metrics import WorkerMetrics


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
        self.cache: str | None = None  # the embedding cache's figures, when it is on

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
            + (f"; cache: {self.cache}" if self.cache else "")
        )


def account(summary: RunSummary, metrics: WorkerMetrics, published: PublishedBatch) -> None:
    """A published batch, in the run's summary and the metrics."""
    records = published.rows + published.dead_lettered
    summary.records += records
    summary.rows += published.rows
    summary.dead_lettered += published.dead_lettered
    summary.batches += 1
    metrics.records.labels("embedded").inc(published.rows)
    metrics.records.labels("dead_lettered").inc(published.dead_lettered)
    metrics.dead_letter.inc(published.dead_lettered)
    metrics.batches.inc()


def update_lag(
    metrics: WorkerMetrics, consumer: Any, committed: Mapping[tuple[str, int], int]
) -> None:
    """Lag per owned partition: high watermark (from fetches) minus committed offset,
    its age in seconds and the committed offset; the series of partitions no longer
    owned (or not committed since they were taken) go away."""
    positions: dict[tuple[str, int], tuple[int, int]] = {}
    for tp in consumer.assignment():
        highwater = consumer.highwater(tp)
        offset = committed.get((tp.topic, tp.partition))
        if highwater is not None and offset is not None:
            positions[(tp.topic, tp.partition)] = (highwater, offset)
    metrics.set_partition_lag(positions, time.monotonic())
