"""`pipeline index check`: the index against the Parquet files, read independently
(and in upsert mode against the current view, given as `judged`: the versions it has
superseded or deleted must not be served).

Every id in the shard files is compared with the (topic, partition, offset) of
every Parquet row the index claims to cover (offsets up to its coverage): none
missing, none extra, none twice; in an output of chunks, with each row's `chunk`
too, so a record missing one chunk's vector is a missing row. Reads the ids and the
offset (and chunk) columns, never the vectors, so it runs in seconds on millions of
rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.chunks import CHUNK
from pipeline.core.documents import DELETED
from pipeline.core.errors import IndexStateError
from pipeline.core.layout import TopicPartitionKey, iter_segments, segments_by_partition
from sinks.index import metric as metrics
from sinks.index.ids import IdLayout, row_chunks
from sinks.index.shards import table_vectors
from sinks.index.store import IndexMeta, IndexStore
from sinks.index.trained import RECALL_QUERIES, ExactTopK, training_sample
from sinks.segments import read_table, with_vectors

# Upsert mode: the current view's positions and live offsets per partition (sinks.view:
# ViewStore.snapshot); of the rows it has judged, only the live ones are expected.
Judged = tuple[Mapping[TopicPartitionKey, int], Mapping[TopicPartitionKey, np.ndarray]]


@dataclass(frozen=True)
class IndexReport:
    index_type: str
    vectors: int
    shards: int
    bytes: int
    generation: int
    recall_at_10: float | None
    missing: int  # covered Parquet rows with no id
    extra: int  # ids with no covered Parquet row
    doubled: int  # ids present more than once
    uncovered_rows: int  # Parquet rows past the coverage: a worker's next sync adds them
    measured_recall_at_10: float | None = None  # measured now, with --recall
    # What it searches by (sinks.index.metric); None: built before it was recorded.
    similarity: str | None = None

    @property
    def ok(self) -> bool:
        return self.missing == self.extra == self.doubled == 0

    def as_dict(self) -> dict[str, Any]:
        return dict(asdict(self), ok=self.ok)


def check_index(output: Path, recall: bool = False, judged: Judged | None = None) -> IndexReport:
    """The report; with `recall`, also recall@10 of the index as it is searched now
    (trained shard and later flat shards together) against exact search over the
    Parquet vectors, for RECALL_QUERIES queries drawn from them."""
    store = IndexStore(output)
    meta, ids, size = store.snapshot()  # one generation; checks every shard against index.json
    if meta is None:
        raise IndexStateError(f"no index in {store.directory}; run: pipeline index rebuild")
    unique, counts = np.unique(ids, return_counts=True)
    expected, uncovered = _covered_row_ids(output, meta, judged)
    return IndexReport(
        index_type=meta.index_type,
        vectors=len(ids),
        shards=len(meta.shards),
        bytes=size,
        generation=meta.generation,
        recall_at_10=meta.recall_at_10,
        missing=int(np.setdiff1d(expected, unique, assume_unique=True).size),
        extra=int(np.setdiff1d(unique, expected, assume_unique=True).size),
        doubled=int((counts > 1).sum()),
        uncovered_rows=uncovered,
        measured_recall_at_10=measure_recall(output, store, meta) if recall else None,
        similarity=meta.similarity,
    )


def measure_recall(
    output: Path, store: IndexStore, meta: IndexMeta, queries: int = RECALL_QUERIES
) -> float:
    """Recall@10 of the loaded index against exact search by its similarity, streaming
    the Parquet files."""
    segments = list(iter_segments(output))
    sample, _ = training_sample(segments)
    if not len(sample):
        raise IndexStateError(f"no vectors under {output}/vectors to measure recall on")
    rng = np.random.default_rng(1)
    picked = sample[rng.choice(len(sample), min(queries, len(sample)), replace=False)]
    exact = ExactTopK(metrics.prepare(picked, meta.similarity), meta.metric)
    layout = meta.layout
    for segment in segments:
        table = read_table(segment, ["offset", "embedding"], optional=[CHUNK])
        topic_no = meta.topics.get(segment.key.topic)
        if topic_no is None or not table.num_rows:
            continue
        offsets = table.column("offset").to_numpy().astype(np.int64)
        vectors = metrics.prepare(table_vectors(table), meta.similarity)
        ids = layout.encode_many(topic_no, segment.key.partition, offsets, row_chunks(table))
        exact.add(vectors, ids)
    store.load()
    found = store.search(picked, 10)
    ids = [
        {layout.encode(meta.topics[h.topic], h.partition, h.offset, h.chunk) for h in hits}
        for hits in found
    ]
    truth = exact.ids()
    return float(
        np.mean([len(set(t.tolist()) & f) / len(t) for t, f in zip(truth, ids, strict=True)])
    )


def _covered_row_ids(output: Path, meta: IndexMeta, view: Judged | None) -> tuple[np.ndarray, int]:
    """The ids of the rows the index covers (in its layout), and how many rows lie past
    its coverage."""
    parts = [np.empty(0, dtype=np.int64)]
    uncovered = 0
    judged, live = view if view is not None else ({}, {})
    layout: IdLayout = meta.layout
    for (topic, partition), segments in segments_by_partition(output).items():
        through = meta.covered.get(f"{topic}:{partition}", -1)
        for segment in segments:
            try:
                table = read_table(segment, ["offset"], optional=[DELETED, CHUNK])
            except (OSError, ValueError) as exc:
                raise IndexStateError(f"cannot read {segment.where}: {exc}") from exc
            kept = with_vectors(table)
            offsets_np = table.column("offset").to_numpy().astype(np.int64)[kept]
            chunks = row_chunks(table)[kept]
            if DELETED in table.column_names:  # upsert mode: what the view judged
                seen = offsets_np <= judged.get((topic, partition), -1)
                alive = np.isin(offsets_np, live.get((topic, partition), offsets_np[:0]))
                offsets_np, chunks = offsets_np[~seen | alive], chunks[~seen | alive]
            inside = offsets_np <= through
            uncovered += len(offsets_np) - int(inside.sum())
            if inside.any():  # a covered partition's topic has a number
                topic_no = meta.topics[topic]
                parts.append(
                    layout.encode_many(topic_no, partition, offsets_np[inside], chunks[inside])
                )
    return np.unique(np.concatenate(parts)), uncovered
