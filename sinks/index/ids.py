"""The ids of the index's vectors: each derived from its row's place, so that one row
can never get two entries (sinks.index.store), in one of two layouts (IdLayout)
recorded in index.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.core.chunks import CHUNK
from pipeline.core.errors import IndexStateError

__all__ = [
    "CHUNKED_IDS",
    "PLAIN_IDS",
    "ChunksInPlainIndex",
    "IdLayout",
    "decode_id",
    "encode_id",
    "id_layout",
    "row_chunks",
]

_TOPIC_SHIFT = 56
_MAX_TOPICS = 1 << 7


@dataclass(frozen=True)
class IdLayout:
    """How a vector's id is made of its row's place, the one object that does the bit
    arithmetic (topic_no: the small number per topic that index.json fixes).

    plain (one row per offset):  topic_no << 56 | partition << 40 | offset
        (partitions < 2**16, offsets < 2**40, chunk always 0);
    chunked (several rows per offset, `pipeline run --chunk-tokens`):
        topic_no << 56 | partition << 44 | offset << 8 | chunk
        (partitions < 2**12, offsets < 2**36, chunks < 2**8).

    Both keep ids below 2**63 (a FAISS id is a signed int64); a place outside the
    bounds is refused with IndexStateError, never wrapped. The layout of an index is
    recorded in index.json (IndexMeta.chunks)."""

    chunked: bool

    @property
    def partition_shift(self) -> int:
        return 44 if self.chunked else 40

    @property
    def offset_shift(self) -> int:
        return 8 if self.chunked else 0

    @property
    def max_partitions(self) -> int:
        return 1 << (_TOPIC_SHIFT - self.partition_shift)

    @property
    def max_offset(self) -> int:
        return (1 << (self.partition_shift - self.offset_shift)) - 1

    @property
    def max_chunks(self) -> int:
        return 1 << self.offset_shift

    @property
    def name(self) -> str:
        return "chunked" if self.chunked else "plain"

    def base(self, topic_no: int, partition: int) -> int:
        """The id of (offset 0, chunk 0) of a partition: every id of it is this
        | offset << offset_shift | chunk."""
        if not (0 <= topic_no < _MAX_TOPICS and 0 <= partition < self.max_partitions):
            raise IndexStateError(
                f"topic #{topic_no} partition {partition} does not fit an index id "
                f"({self.name} layout: topics < {_MAX_TOPICS}, partitions < "
                f"{self.max_partitions})"
            )
        return (topic_no << _TOPIC_SHIFT) | (partition << self.partition_shift)

    def encode(self, topic_no: int, partition: int, offset: int, chunk: int = 0) -> int:
        base = self.base(topic_no, partition)
        self._check(offset, offset, chunk, chunk)
        return base | (offset << self.offset_shift) | chunk

    def decode(self, vector_id: int) -> tuple[int, int, int, int]:
        """(topic_no, partition, offset, chunk) of an id."""
        return (
            vector_id >> _TOPIC_SHIFT,
            (vector_id >> self.partition_shift) & (self.max_partitions - 1),
            (vector_id >> self.offset_shift) & self.max_offset,
            vector_id & (self.max_chunks - 1),
        )

    def encode_many(
        self,
        topic_no: int | np.ndarray,
        partition: int | np.ndarray,
        offsets: np.ndarray,
        chunks: np.ndarray | None = None,
    ) -> np.ndarray:
        """The ids (int64) of rows at `offsets` (and `chunks`; None: all 0) of one
        partition, or of arrays of topic numbers and partitions as long as `offsets`."""
        offsets = np.asarray(offsets, dtype=np.int64)
        chunks = np.zeros_like(offsets) if chunks is None else np.asarray(chunks, np.int64)
        if chunks.shape != offsets.shape:
            raise IndexStateError(f"{len(chunks)} chunks for {len(offsets)} offsets")
        topics = np.asarray(topic_no, dtype=np.int64)
        partitions = np.asarray(partition, dtype=np.int64)
        if not offsets.size:
            return np.empty(0, dtype=np.int64)
        for t in np.unique(topics):  # checked once each: few topics, few partitions
            for p in np.unique(partitions):
                self.base(int(t), int(p))
        self._check(int(offsets.min()), int(offsets.max()), int(chunks.min()), int(chunks.max()))
        return (
            (topics << _TOPIC_SHIFT)
            | (partitions << self.partition_shift)
            | (offsets << self.offset_shift)
            | chunks
        )

    def decode_many(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(topic_nos, partitions, offsets, chunks) of an array of ids."""
        ids = np.asarray(ids, dtype=np.int64)
        return (
            ids >> _TOPIC_SHIFT,
            (ids >> self.partition_shift) & (self.max_partitions - 1),
            (ids >> self.offset_shift) & self.max_offset,
            ids & (self.max_chunks - 1),
        )

    def _check(self, low_offset: int, high_offset: int, low_chunk: int, high_chunk: int) -> None:
        if low_offset < 0 or high_offset > self.max_offset:
            bad = low_offset if low_offset < 0 else high_offset
            raise IndexStateError(
                f"offset {bad} does not fit an index id ({self.name} layout: offsets "
                f"< 2**{self.partition_shift - self.offset_shift})"
            )
        if low_chunk < 0 or high_chunk >= self.max_chunks:
            bad = low_chunk if low_chunk < 0 else high_chunk
            if not self.chunked:
                raise ChunksInPlainIndex(
                    f"chunk {bad} does not fit a plain index id: the index was made for rows "
                    "of one offset each, and the output now holds chunks; run: pipeline "
                    "index rebuild"
                )
            raise IndexStateError(
                f"chunk {bad} does not fit an index id (chunks < {self.max_chunks}: "
                "--max-chunks bounds them)"
            )


class ChunksInPlainIndex(IndexStateError):
    """A row of chunk > 0 met by an index made in the plain layout (IdLayout): only a
    rebuild, which makes it chunked, gives such rows ids."""


PLAIN_IDS = IdLayout(chunked=False)
CHUNKED_IDS = IdLayout(chunked=True)


def id_layout(chunks: bool) -> IdLayout:
    return CHUNKED_IDS if chunks else PLAIN_IDS


def encode_id(topic_no: int, partition: int, offset: int) -> int:
    """The id of a row in the plain layout (IdLayout)."""
    return PLAIN_IDS.encode(topic_no, partition, offset)


def decode_id(vector_id: int) -> tuple[int, int, int]:
    """(topic_no, partition, offset) of an id in the plain layout (IdLayout)."""
    return PLAIN_IDS.decode(vector_id)[:3]


def row_chunks(table: Any) -> np.ndarray:
    """The `chunk` column of a segment's rows as int64 (all 0 where it has none)."""
    if CHUNK not in table.column_names:
        return np.zeros(table.num_rows, dtype=np.int64)
    return table.column(CHUNK).to_numpy(zero_copy_only=False).astype(np.int64)
