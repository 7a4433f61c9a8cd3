"""Flat shard merges streamed from the files' bytes: the same file faiss writes, for
each metric an index searches by (inner product, L2, L1: sinks.index.metric)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sinks.index.flat_files import (
    faiss_flat,
    flat_file_bytes,
    flat_layout,
    merge_flat_files,
    write_flat_file,
)
from sinks.index.metric import METRIC_INNER_PRODUCT, METRIC_L1, METRIC_L2
from sinks.index.shards import (
    contents,
    read_index_file,
    write_index_file,
)

METRICS = [METRIC_INNER_PRODUCT, METRIC_L2, METRIC_L1]


def _shard(
    path: Path, vectors: np.ndarray, ids: np.ndarray, metric: int = METRIC_INNER_PRODUCT
) -> tuple[Path, int]:
    index = faiss_flat(vectors.shape[1], metric)
    index.add_with_ids(vectors, ids)
    write_index_file(index, path)
    return path, len(ids)


def test_the_metric_constants_are_faiss_own() -> None:
    import faiss

    assert (METRIC_INNER_PRODUCT, METRIC_L2, METRIC_L1) == (
        faiss.METRIC_INNER_PRODUCT,
        faiss.METRIC_L2,
        faiss.METRIC_L1,
    )
    for metric in METRICS:
        assert faiss_flat(4, metric).metric_type == metric


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dim", [8, 384])
def test_streamed_merge_is_the_file_faiss_writes(tmp_path: Path, dim: int, metric: int) -> None:
    import faiss

    rng = np.random.default_rng(dim)
    parts = []
    for count in [5, 0, 1, 300]:
        vectors = rng.standard_normal((count, dim)).astype(np.float32)
        ids = rng.integers(0, 1 << 62, count, dtype=np.int64)
        parts.append((vectors, ids))
    sources = [_shard(tmp_path / f"s{n}.faiss", v, i, metric) for n, (v, i) in enumerate(parts)]

    size = merge_flat_files(sources, tmp_path / "merged.faiss", dim, metric)
    assert size is not None

    expected = faiss_flat(dim, metric)
    for vectors, ids in parts:
        if len(ids):
            expected.add_with_ids(vectors, ids)
    data = (tmp_path / "merged.faiss").read_bytes()
    assert size == len(data)
    assert data == bytes(faiss.serialize_index(expected))
    vectors, ids = contents(read_index_file(tmp_path / "merged.faiss", 306, metric))
    np.testing.assert_array_equal(vectors, np.concatenate([v for v, _ in parts]))
    np.testing.assert_array_equal(ids, np.concatenate([i for _, i in parts]))


def test_a_source_without_the_layout_is_left_to_faiss(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    good = _shard(tmp_path / "good.faiss", rng.standard_normal((4, 8)).astype(np.float32),
                  np.arange(4, dtype=np.int64))  # fmt: skip
    cut = _shard(tmp_path / "cut.faiss", rng.standard_normal((4, 8)).astype(np.float32),
                 np.arange(4, 8, dtype=np.int64))  # fmt: skip
    with open(cut[0], "r+b") as fh:
        fh.truncate(fh.seek(0, 2) - 8)

    assert merge_flat_files([good, cut], tmp_path / "merged.faiss", 8) is None
    assert merge_flat_files([good, (cut[0], 5)], tmp_path / "merged.faiss", 8) is None
    assert not (tmp_path / "merged.faiss").exists()


def test_a_source_of_another_metric_is_left_to_faiss(tmp_path: Path) -> None:
    """An L2 shard has another header than an inner-product one: never streamed into it."""
    rng = np.random.default_rng(2)
    vectors = rng.standard_normal((4, 8)).astype(np.float32)
    ip = _shard(tmp_path / "ip.faiss", vectors, np.arange(4, dtype=np.int64))
    l2 = _shard(tmp_path / "l2.faiss", vectors, np.arange(4, 8, dtype=np.int64), METRIC_L2)
    assert merge_flat_files([ip, l2], tmp_path / "merged.faiss", 8) is None
    assert merge_flat_files([ip, l2], tmp_path / "merged.faiss", 8, METRIC_L2) is None
    assert not (tmp_path / "merged.faiss").exists()


@pytest.mark.parametrize("metric", METRICS)
def test_layout_header_counts_vectors(metric: int) -> None:
    layout = flat_layout(16, metric)
    assert layout is not None
    assert len(layout.count_at) == 2  # the id map's and the flat index's ntotal
    size = flat_file_bytes(16, 10, metric)
    assert size == len(layout.header(10)) + 10 * 16 * 4 + 8 + 10 * 8


@pytest.mark.parametrize("metric", METRICS)
def test_a_shard_written_from_parts_is_the_file_faiss_writes(tmp_path: Path, metric: int) -> None:
    import faiss

    rng = np.random.default_rng(7)
    parts = [
        (rng.standard_normal((n, 384)).astype(np.float32), np.arange(n, dtype=np.int64) + 9 * n)
        for n in (3, 1, 200)
    ]
    size = write_flat_file(tmp_path / "shard.faiss", parts, metric)

    expected = faiss_flat(384, metric)
    for vectors, ids in parts:
        expected.add_with_ids(vectors, ids)
    data = (tmp_path / "shard.faiss").read_bytes()
    assert size == len(data)
    assert data == bytes(faiss.serialize_index(expected))


def test_a_write_that_fails_is_one_output_error_and_leaves_nothing(tmp_path: Path) -> None:
    from pipeline.core.errors import OutputError

    parts = [(np.ones((2, 8), dtype=np.float32), np.arange(2, dtype=np.int64))]
    with pytest.raises(OutputError):
        write_flat_file(tmp_path / "missing-dir" / "shard.faiss", parts)
    assert not (tmp_path / "missing-dir").exists()
