"""The files of the FAISS index: its metadata, its shards, and how shards merge.

The index of an output directory is a list of immutable shard files named in
`index/index.json`. A sync writes only the vectors that are new since the last
one, as new shards; it never reads or rewrites the shards already there, so its
cost and memory follow the work in flight, not the corpus. Readers (`pipeline
search`, checks) load every listed shard and add them up into one index.

Small shards are merged like Lucene's segments: shards below half the size cap
fall into tiers by powers of `MERGE_FANOUT`, and a tier holding `MERGE_FANOUT`
shards is merged into one, never past the cap. Each vector is so merged a few
times at most (log base 8 of the cap), and a corpus of N vectors lies in about
2N / cap shards. Only flat shards merge; an IVF shard (one, from `pipeline
index rebuild --index-type ivf`) comes first and later flat shards add to it when
a reader loads the index.

index.json is the commit point: files are written and fsynced first, then
index.json is replaced by a rename. A crash leaves the previous list intact, and
the next save removes the files no list names.

Every shard of an index compares vectors by one FAISS metric, the one its
similarity asks for (sinks.index.metric), recorded in index.json as `similarity`.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pipeline.core.errors import IndexStateError
from sinks.index import metric as metrics
from sinks.index.flat_files import (
    faiss_flat,
    flat_file_bytes,
    flat_layout,
    vector_bytes,
    write_flat_file,
)
from sinks.index.ids import IdLayout, id_layout
from sinks.index.ids import decode_id as decode_id  # the plain layout's, as before
from sinks.index.ids import encode_id as encode_id

FLAT = "flat"
IVF = "ivf"
IVF_PQ = "ivf-pq"
INDEX_TYPES = (FLAT, IVF, IVF_PQ)
# A shard's size cap: what a sync or a merge holds in memory at most (twice that
# while the vector grows). 32 MiB is ~21,000 vectors of 384 floats.
SHARD_CAP_BYTES = 32 << 20
MERGE_FANOUT = 8
_INDEX_FILE = re.compile(
    r"^(?:(?:shard|index|ivf|ivf-pq)-\d{8}(?:-\d{4,})?(?:-[0-9a-z_.]+)?\.faiss"
    r"|removed-\d{8}-\d{4,}(?:-[0-9a-z_.]+)?\.npy)$"
)


@dataclass(frozen=True)
class Shard:
    file: str
    count: int
    kind: str = FLAT  # FLAT, or a trained type (IVF, IVF_PQ) for the base shard


@dataclass
class IndexMeta:
    dim: int
    index_type: str = FLAT
    topics: dict[str, int] = field(default_factory=dict)
    covered: dict[str, int] = field(default_factory=dict)  # "topic:partition" -> last offset
    entries: dict[str, int] = field(default_factory=dict)  # "topic:partition" -> vectors
    generation: int = 0
    model: dict[str, str] = field(default_factory=dict)
    shards: list[Shard] = field(default_factory=list)
    recall_at_10: float | None = None  # of a trained index against exact search
    # The similarity it searches by (sinks.index.metric); None: built before it was
    # recorded, an inner product over the stored vectors.
    similarity: str | None = None
    # Files of ids no longer served (upsert mode: sinks.index.removed).
    removed: list[Shard] = field(default_factory=list)
    # The id layout (IdLayout): True for outputs of chunks (rows with a `chunk` column,
    # several per offset), chosen when the index is made; absent (False): plain.
    chunks: bool = False

    @property
    def layout(self) -> IdLayout:
        return id_layout(self.chunks)

    @property
    def files(self) -> list[str]:
        """Every file this generation names: its shards and its removals."""
        return [s.file for s in self.shards] + [r.file for r in self.removed]

    @property
    def removed_total(self) -> int:
        return sum(r.count for r in self.removed)

    @property
    def metric(self) -> int:
        """The FAISS metric of every shard."""
        return metrics.faiss_metric(self.similarity)

    @property
    def count(self) -> int:
        return sum(self.entries.values())

    @property
    def shard_total(self) -> int:
        return sum(s.count for s in self.shards)

    def topic_no(self, topic: str) -> int:
        if topic not in self.topics:
            self.topics[topic] = len(self.topics)
        return self.topics[topic]

    def to_json(self) -> str:
        data = dict(
            asdict(self), count=self.count, shard_files=len(self.shards), updated_at=time.time()
        )
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> IndexMeta:
        data = json.loads(text)
        entries = {k: int(v) for k, v in data.get("entries", {}).items()}
        index_type = data.get("index_type", FLAT)
        if "shards" in data:
            shards = [
                Shard(str(s["file"]), int(s["count"]), str(s["kind"])) for s in data["shards"]
            ]
        elif data.get("index_file"):  # one whole file, as versions before shards saved it
            shards = [Shard(str(data["index_file"]), sum(entries.values()), index_type)]
        else:
            shards = []
        recall = data.get("recall_at_10")
        similarity = metrics.checked(data.get("similarity"))
        removed = [
            Shard(str(r["file"]), int(r["count"]), str(r["kind"])) for r in data.get("removed", [])
        ]
        return cls(
            dim=int(data["dim"]),
            index_type=index_type,
            topics={k: int(v) for k, v in data.get("topics", {}).items()},
            covered={k: int(v) for k, v in data.get("covered", {}).items()},
            entries=entries,
            generation=int(data.get("generation", 0)),
            model=dict(data.get("model", {})),
            shards=shards,
            recall_at_10=None if recall is None else float(recall),
            similarity=similarity,
            removed=removed,
            chunks=bool(data.get("chunks", False)),
        )


# -- shard files ---------------------------------------------------------------------


def is_index_file(name: str) -> bool:
    return bool(_INDEX_FILE.match(name))


def shard_name(generation: int, seq: int, tag: str = "") -> str:
    return f"shard-{generation:08d}-{seq:04d}{tag}.faiss"


def cap_vectors(dim: int, cap_bytes: int = SHARD_CAP_BYTES) -> int:
    return max(1024, cap_bytes // vector_bytes(dim))


def preload(dim: int) -> None:
    """Imports faiss and reads its shard layouts now, at start-up: left to the first
    index sync, half a minute into a run, it added to a running worker's memory."""
    for metric in metrics.METRIC_NAMES:
        flat_file_bytes(dim, 0, metric)
        flat_layout(dim, metric)


def write_index_file(index: Any, path: Path) -> int:
    """Writes and fsyncs an index file; returns its size."""
    import faiss

    faiss.write_index(index, str(path))
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
        return os.fstat(fh.fileno()).st_size


def read_index_file(path: Path, expected: int, metric: int | None = None) -> Any:
    """The index in `path`, checked to hold `expected` vectors (and to compare them
    by `metric`, where given)."""
    import faiss

    try:
        index = faiss.read_index(str(path))
    except RuntimeError as exc:
        raise IndexStateError(f"cannot read the index file {path}: {exc}") from exc
    if int(index.ntotal) != expected:
        raise IndexStateError(
            f"the index file {path} holds {index.ntotal} vectors but index.json says {expected}"
        )
    if metric is not None and int(index.metric_type) != metric:
        found = metrics.METRIC_NAMES.get(int(index.metric_type), str(index.metric_type))
        raise IndexStateError(
            f"the index file {path} compares by {found} but index.json's similarity asks for "
            f"{metrics.METRIC_NAMES[metric]}"
        )
    return index


def contents(index: Any) -> tuple[np.ndarray, np.ndarray]:
    """The vectors and ids of a flat shard."""
    import faiss

    n = int(index.ntotal)
    vectors = faiss.downcast_index(index.index).reconstruct_n(0, n) if n else None
    ids = faiss.vector_to_array(index.id_map).astype(np.int64)
    if vectors is None:
        vectors = np.empty((0, index.d), dtype=np.float32)
    return vectors, ids


def ids_of(index: Any) -> np.ndarray:
    import faiss

    return faiss.vector_to_array(index.id_map).astype(np.int64)


# -- merging -------------------------------------------------------------------------


def _tier(count: int) -> int:
    return int(math.log(max(count, 1), MERGE_FANOUT))


def next_merge(shards: Iterable[Shard], cap: int) -> list[Shard]:
    """The shards to merge next (empty: none): the smallest tier holding MERGE_FANOUT
    flat shards below half the cap, as many of its smallest as fit under the cap."""
    tiers: dict[int, list[Shard]] = {}
    for shard in shards:
        if shard.kind == FLAT and shard.count * 2 <= cap:
            tiers.setdefault(_tier(shard.count), []).append(shard)
    for tier in sorted(tiers):
        members = sorted(tiers[tier], key=lambda s: s.count)
        if len(members) < MERGE_FANOUT:
            continue
        group: list[Shard] = []
        for shard in members:
            if sum(s.count for s in group) + shard.count > cap:
                break
            group.append(shard)
        if len(group) >= 2:
            return group
    return []


# -- writing -------------------------------------------------------------------------


@dataclass
class SyncStats:
    """What the last sync or rebuild did, for logs, metrics and the scale benchmark."""

    added: int = 0
    shards_written: int = 0
    shards_merged: int = 0
    bytes_written: int = 0
    seconds: float = 0.0


class VectorSink(Protocol):
    """Where a sync or rebuild puts the vectors it reads: flat shards or a trained index."""

    def add(self, vectors: np.ndarray, ids: np.ndarray) -> None: ...

    def finish(self) -> list[Shard]: ...


@dataclass
class FileNames:
    """Names of the files one save writes: all carry the generation it commits, and
    `tag` (`-<writer token>`) where writers commit without taking turns."""

    generation: int
    tag: str = ""
    seq: int = 0

    def next(self) -> str:
        self.seq += 1
        return shard_name(self.generation, self.seq, self.tag)

    def trained(self, kind: str) -> str:
        return f"{kind}-{self.generation:08d}{self.tag}.faiss"


def write_checked(index: Any, path: Path) -> int:
    """write_index_file, with an OSError turned into one actionable OutputError."""
    from sinks.parquet import output_error

    try:
        return write_index_file(index, path)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise output_error(exc, path) from exc


@dataclass
class FlatShardWriter:
    """Buffers new vectors and writes them as flat shards of about `cap` vectors
    (None: SHARD_CAP_BYTES' worth, known once the dimension is)."""

    directory: Path
    names: FileNames
    cap: int | None
    stats: SyncStats
    metric: int = metrics.METRIC_INNER_PRODUCT  # the index's (IndexMeta.metric)
    _vectors: list[np.ndarray] = field(default_factory=list)
    _ids: list[np.ndarray] = field(default_factory=list)
    _buffered: int = 0
    _written: list[Shard] = field(default_factory=list)

    def add(self, vectors: np.ndarray, ids: np.ndarray) -> None:
        self._vectors.append(np.ascontiguousarray(vectors, dtype=np.float32))
        self._ids.append(ids.astype(np.int64))
        self._buffered += len(ids)
        if self.cap is None:
            self.cap = cap_vectors(vectors.shape[1])
        if self._buffered >= self.cap:
            self._flush()

    def finish(self) -> list[Shard]:
        self._flush()
        return self._written

    def _flush(self) -> None:
        if not self._buffered:
            return
        name = self.names.next()
        self.stats.bytes_written += self._write(self.directory / name)
        self._vectors, self._ids = [], []
        self.stats.shards_written += 1
        self._written.append(Shard(name, self._buffered))
        self._buffered = 0

    def _write(self, path: Path) -> int:
        """Writes the buffered parts as they are: one gathered copy and a faiss index
        of them would double a shard's memory."""
        size = write_flat_file(path, list(zip(self._vectors, self._ids, strict=True)), self.metric)
        if size is not None:
            return size
        index = faiss_flat(self._vectors[0].shape[1], self.metric)
        index.add_with_ids(np.concatenate(self._vectors), np.concatenate(self._ids))
        return write_checked(index, path)


def table_vectors(table: Any) -> np.ndarray:
    """The `embedding` column of a Parquet table as an (n, dim) float32 array."""
    column = table.column("embedding").combine_chunks()
    if len(column) == 0:
        return np.empty((0, 0), dtype=np.float32)
    dim = column.type.list_size
    return (
        column.values.to_numpy(zero_copy_only=False).reshape(-1, dim).astype(np.float32, copy=False)
    )
