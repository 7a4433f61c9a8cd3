"""The vectors a pipeline run stored, against a reference computed for the same
records: row count, one row per record, cosine, neighbour recall, the precision
gate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness import HarnessError
from pipeline.model.precision import (
    DEFAULT_MIN_COSINE,
    DEFAULT_MIN_RECALL,
    cosine_rows,
    neighbour_recall,
)


@dataclass(frozen=True)
class Quality:
    rows: int
    expected: int
    distinct_ids: int
    cosine_mean: float
    cosine_min: float
    recall_at_10: float

    @property
    def passed(self) -> bool:
        return (
            self.rows == self.expected == self.distinct_ids
            and self.cosine_mean >= DEFAULT_MIN_COSINE
            and self.recall_at_10 >= DEFAULT_MIN_RECALL
        )


def read_vectors(output: Path) -> tuple[list[str], np.ndarray]:
    """Ids and embeddings of every published Parquet file of a pipeline output dir."""
    import pyarrow.parquet as pq

    from pipeline.core.layout import iter_segments

    ids: list[str] = []
    blocks: list[np.ndarray] = []
    for segment in iter_segments(output):
        table = pq.read_table(segment.path, columns=["id", "embedding"])
        if table.num_rows == 0:
            continue
        column = table.column("embedding").combine_chunks()
        dim = column.type.list_size
        blocks.append(column.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim))
        ids += table.column("id").to_pylist()
    if not blocks:
        raise HarnessError(f"(d) wrote no vectors under {output}")
    return ids, np.concatenate(blocks).astype(np.float32, copy=False)


def quality(output: Path, ids: list[str], reference: np.ndarray) -> Quality:
    """(d)'s stored vectors against fp32 ones, rows matched by id."""
    stored_ids, stored = read_vectors(output)
    position = {record_id: n for n, record_id in enumerate(ids)}
    unknown = [i for i in stored_ids if i not in position]
    if unknown:
        raise HarnessError(f"(d) stored {len(unknown)} ids that were not published: {unknown[:3]}")
    rows = np.fromiter((position[i] for i in stored_ids), dtype=np.int64, count=len(stored_ids))
    # Compare each published record once (duplicates, if any, show in distinct_ids).
    first = np.unique(rows, return_index=True)[1]
    ref, cand = reference[rows[first]], stored[first]
    cosine = cosine_rows(ref, cand)
    return Quality(
        rows=len(stored_ids),
        expected=len(ids),
        distinct_ids=len(first),
        cosine_mean=float(cosine.mean()),
        cosine_min=float(cosine.min()),
        recall_at_10=neighbour_recall(ref, cand),
    )


def render_quality(q: Quality, precision: str) -> list[str]:
    return [
        f"quality of (d)'s stored vectors ({precision}) against fp32 (sentence-transformers):",
        f"  rows {q.rows} for {q.expected} records ({q.distinct_ids} distinct ids), "
        f"cosine mean {q.cosine_mean:.5f}, min {q.cosine_min:.5f}, "
        f"recall@10 {q.recall_at_10:.3f}",
        f"  {'PASS' if q.passed else 'FAIL'} (gate: every record once, cosine mean >= "
        f"{DEFAULT_MIN_COSINE}, recall@10 >= {DEFAULT_MIN_RECALL})",
    ]
