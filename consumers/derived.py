"""The outputs derived from the published segments: the FAISS index (sinks.index)
and, in upsert mode, the current view (sinks.view). Stages keep them in step during
a run (consumers.stages); a worker catches both up at start, and at exit, so that
every file published before it exits is in them."""

from __future__ import annotations

import logging

from pipeline.core.metrics import WorkerMetrics
from sinks.index.store import IndexStore
from sinks.view import ViewStore
from sinks.view_lock import LEASE_S

log = logging.getLogger(__name__)


def catch_up(
    index: IndexStore, view: ViewStore | None, metrics: WorkerMetrics, starting: bool
) -> None:
    """Syncs the index, then the view, with every published segment."""
    added = index.sync()
    if index.meta is not None:
        metrics.index_vectors.set(index.meta.count)
    if starting and added:
        log.info("index caught up with %d vectors from existing Parquet files", added)
    # At exit, the view is complete too: a lease another worker held (one killed holds
    # it to its end) is waited for.
    applied = view.sync(wait_s=0.0 if starting else LEASE_S + 10) if view is not None else 0
    if starting and applied:
        log.info("view caught up with %d existing Parquet rows", applied)
    if view is not None and not starting:
        view.close()
