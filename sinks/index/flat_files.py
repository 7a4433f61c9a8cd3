"""Merging flat shard files by streaming their bytes, without loading them.

A merge through faiss holds every source's vectors and the merged index at once,
and the merged vector grows by doubling: up to three times the shard cap on top of
the worker's working set, whatever else it is doing.
A flat shard file is a fixed header, the vectors, then the ids, so the merged
file is the sources' vectors one after another, then their ids: copied in
chunks, it costs a chunk of memory.

The layout is not hard-coded: it is read off faiss's own serialisation of small
indexes (the header's count fields and where the vectors and ids start), then an
index assembled that way must equal faiss's bytes exactly. If this faiss writes
anything else, `flat_layout` is None and merges go through faiss as before
(`PIPELINE_FLAT_FILES=faiss` does the same, for measuring one against the other).
Each FAISS metric (sinks.index.metric: inner product, L2, L1) has a header of its
own, so every function here takes the metric with the dimension.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from sinks.index.metric import METRIC_INNER_PRODUCT, METRIC_L2

_COUNT = struct.Struct("<q")
_CHUNK_BYTES = 1 << 20
# A count whose bytes differ from one another, to find the count fields in a header.
_PROBE = 258


def vector_bytes(dim: int) -> int:
    return dim * 4 + 8  # the float32 vector and its int64 id


@lru_cache(maxsize=8)
def _flat_header_bytes(dim: int, metric: int) -> int:
    import faiss

    return len(faiss.serialize_index(faiss_flat(dim, metric)))


def flat_file_bytes(dim: int, count: int, metric: int = METRIC_INNER_PRODUCT) -> int:
    """The exact size of a flat shard file of `count` vectors: checked without reading it."""
    return _flat_header_bytes(dim, metric) + count * vector_bytes(dim)


def faiss_flat(dim: int, metric: int = METRIC_INNER_PRODUCT) -> Any:
    """An empty flat shard: exact search by `metric` (a FAISS MetricType), with ids."""
    import faiss

    if metric == METRIC_INNER_PRODUCT:
        flat = faiss.IndexFlatIP(dim)
    elif metric == METRIC_L2:
        flat = faiss.IndexFlatL2(dim)
    else:
        flat = faiss.IndexFlat(dim, metric)
    return faiss.IndexIDMap2(flat)


@dataclass(frozen=True)
class FlatLayout:
    """Where faiss puts the parts of a flat shard file of `dim`-d vectors."""

    dim: int
    metric: int
    head: bytes  # the file's start for no vectors, up to the vectors' size field
    count_at: tuple[int, ...]  # offsets of the header's vector-count fields in `head`
    vector_units: int  # the vectors' size field counts this many per vector

    def header(self, count: int) -> bytes:
        """The bytes before the vectors of a file of `count` vectors."""
        head = bytearray(self.head)
        for at in self.count_at:
            _COUNT.pack_into(head, at, count)
        return bytes(head) + _COUNT.pack(count * self.vector_units)

    def vectors_bytes(self, count: int) -> int:
        return count * self.dim * 4

    def assemble(self, vectors: np.ndarray, ids: np.ndarray) -> bytes:
        """A whole file in memory: for checking the layout against faiss."""
        count = len(ids)
        return b"".join(
            (
                self.header(count),
                np.ascontiguousarray(vectors, dtype="<f4").tobytes(),
                _COUNT.pack(count),
                np.ascontiguousarray(ids, dtype="<i8").tobytes(),
            )
        )


@lru_cache(maxsize=8)
def flat_layout(dim: int, metric: int = METRIC_INNER_PRODUCT) -> FlatLayout | None:
    """The layout of this faiss's flat shard files, or None where it is not the
    header-vectors-ids layout this module streams."""
    if os.environ.get("PIPELINE_FLAT_FILES") == "faiss":
        return None
    empty = _serialized(dim, metric, 0)
    probe = _serialized(dim, metric, _PROBE)
    if len(empty) < 16 or empty[-16:] != bytes(16):
        return None
    head = empty[:-16]
    zero, probed = _COUNT.pack(0), _COUNT.pack(_PROBE)
    count_at = tuple(
        at
        for at in range(len(head) - 7)
        if head[at : at + 8] == zero and probe[at : at + 8] == probed
    )
    size_field = int.from_bytes(probe[len(head) : len(head) + 8], "little")
    if not count_at or size_field % _PROBE:
        return None
    layout = FlatLayout(dim, metric, head, count_at, size_field // _PROBE)
    rng = np.random.default_rng(dim)
    vectors = rng.standard_normal((3, dim)).astype(np.float32)
    ids = np.array([5, 1 << 40, 17], dtype=np.int64)
    if layout.assemble(vectors, ids) != _serialized(dim, metric, 3, vectors, ids):
        return None
    if layout.header(_PROBE) != probe[: len(head) + 8]:
        return None
    return layout


def _serialized(
    dim: int,
    metric: int,
    count: int,
    vectors: np.ndarray | None = None,
    ids: np.ndarray | None = None,
) -> bytes:
    import faiss

    index = faiss_flat(dim, metric)
    if count:
        if vectors is None or ids is None:
            vectors = np.zeros((count, dim), dtype=np.float32)
            ids = np.arange(count, dtype=np.int64)
        index.add_with_ids(vectors, ids)
    return bytes(faiss.serialize_index(index))


def merge_flat_files(
    sources: list[tuple[Path, int]], target: Path, dim: int, metric: int = METRIC_INNER_PRODUCT
) -> int | None:
    """Writes and fsyncs `target`, the flat shard of every source's vectors in order
    (each source: its path and vector count); returns its size. None, with nothing
    written, where the layout is unknown or a source does not have it: the caller
    merges through faiss, which also names what is wrong with such a file."""
    layout = flat_layout(dim, metric)
    if layout is None or not all(_has_layout(layout, p, n) for p, n in sources):
        return None
    total = sum(n for _, n in sources)
    start = len(layout.head) + 8
    with _staged(target) as out:
        out.write(layout.header(total))
        for path, count in sources:
            _copy(path, start, layout.vectors_bytes(count), out)
        out.write(_COUNT.pack(total))
        for path, count in sources:
            _copy(path, start + layout.vectors_bytes(count) + 8, count * 8, out)
    return flat_file_bytes(dim, total, metric)


def write_flat_file(
    target: Path, parts: list[tuple[np.ndarray, np.ndarray]], metric: int = METRIC_INNER_PRODUCT
) -> int | None:
    """Writes and fsyncs `target`, the flat shard of these (vectors, ids) parts in
    order, without gathering them into one index; returns its size, or None (nothing
    written) where the layout is unknown."""
    dim = parts[0][0].shape[1]
    layout = flat_layout(dim, metric)
    if layout is None:
        return None
    total = sum(len(ids) for _, ids in parts)
    with _staged(target) as out:
        out.write(layout.header(total))
        for vectors, _ in parts:
            out.write(np.ascontiguousarray(vectors, dtype="<f4").data)
        out.write(_COUNT.pack(total))
        for _, ids in parts:
            out.write(np.ascontiguousarray(ids, dtype="<i8").data)
    return flat_file_bytes(dim, total, metric)


@contextlib.contextmanager
def _staged(target: Path) -> Iterator[BinaryIO]:
    """The file open for writing; fsynced after, removed if anything failed, and an
    OSError turned into one actionable OutputError (as write_checked does for faiss)."""
    from sinks.parquet import output_error

    try:
        with open(target, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
    except OSError as exc:
        target.unlink(missing_ok=True)
        raise output_error(exc, target) from exc
    except BaseException:
        target.unlink(missing_ok=True)
        raise


def _has_layout(layout: FlatLayout, path: Path, count: int) -> bool:
    try:
        with open(path, "rb") as fh:
            if fh.read(len(layout.head) + 8) != layout.header(count):
                return False
            fh.seek(len(layout.head) + 8 + layout.vectors_bytes(count))
            if fh.read(8) != _COUNT.pack(count):
                return False
            size = os.fstat(fh.fileno()).st_size
            return size == flat_file_bytes(layout.dim, count, layout.metric)
    except OSError:
        return False


def _copy(path: Path, offset: int, length: int, out: BinaryIO) -> None:
    with open(path, "rb") as source:
        source.seek(offset)
        while length:
            chunk = source.read(min(length, _CHUNK_BYTES))
            if not chunk:
                raise OSError(f"{path} ended {length} bytes early")
            out.write(chunk)
            length -= len(chunk)
