"""What a worker run did, for its last line and the benchmarks that read it."""

from __future__ import annotations

import os
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
        self.rows = 0  # records embedded (or, in upsert mode, deleted)
        self.chunks = 0  # rows of chunked records past their first
        self.dead_lettered = 0
        self.batches = 0
        self.started = time.monotonic()
        self.first_record_at: float | None = None
        self.last_commit_at: float | None = None
        self.cache: str | None = None  # the embedding cache's figures, when it is on
        # Where the time went (`time_spent`): set when the run ends.
        self.time_spent: str | None = None
        self.cpu_at_first_record: os.times_result | None = None

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
        chunks = f" as {self.rows + self.chunks} chunks" if self.chunks else ""
        if self.chunks and busy > 0:  # long records come few a second: chunks say more
            rate_of_chunks = f", {(self.rows + self.chunks) / busy:,.0f} chunks/s"
        else:
            rate_of_chunks = ""
        return (
            f"{self.records} records ({self.rows} embedded{chunks}, "
            f"{self.dead_lettered} dead-lettered) "
            f"in {self.batches} batches, {busy:.1f}s, {rate:,.1f} records/s{rate_of_chunks} "
            f"(first record to last commit; {self.seconds:.1f}s in all)"
            + (f"; cache: {self.cache}" if self.cache else "")
            + (f"; {self.time_spent}" if self.time_spent else "")
        )


def account(summary: RunSummary, metrics: WorkerMetrics, published: PublishedBatch) -> None:
    """A published batch, in the run's summary and the metrics."""
    embedded = published.rows - published.later_chunks
    summary.records += embedded + published.dead_lettered
    summary.rows += embedded
    summary.chunks += published.later_chunks
    summary.dead_lettered += published.dead_lettered
    summary.batches += 1
    metrics.records.labels("embedded").inc(embedded)
    metrics.records.labels("dead_lettered").inc(published.dead_lettered)
    metrics.dead_letter.inc(published.dead_lettered)
    metrics.batches.inc()


def time_spent(
    metrics: WorkerMetrics, since: os.times_result | None = None, engine_cpu_s: float = 0.0
) -> str:
    """Seconds in each stage's work (the embed stage's forward passes and pooling, the
    write stage's files and index, the commits) and the CPU seconds of this process
    since `since` (the first record: start-up left out), of its ended children (the
    tokenizer processes: parsing and tokenizing big polls) and of the model's engine
    processes (`engine_cpu_s`, OpenVINO's replicas: passes): where a run's time goes,
    to compare with its busy seconds."""
    now = os.times()
    own = now.user + now.system - (since.user + since.system if since is not None else 0.0)
    stages = ", ".join(
        f"{name} {_histogram_sum(histogram):.1f}s"
        for name, histogram in (
            ("embed", metrics.embed_seconds),
            ("write", metrics.write_seconds),
            ("commit", metrics.commit_seconds),
        )
    )
    return (
        f"time in stages: {stages}; CPU: worker {own:.1f}s, "
        f"tokenizer processes {now.children_user + now.children_system:.1f}s"
        + (f", engine processes {engine_cpu_s:.1f}s" if engine_cpu_s else "")
    )


def _histogram_sum(histogram: Any) -> float:
    for family in histogram.collect():
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                return float(sample.value)
    return 0.0


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
