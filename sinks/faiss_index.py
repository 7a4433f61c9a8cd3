"""FAISS index over the Parquet files, kept in step with them.

The index is derived data: the Parquet files are the truth, and `IndexStore.sync()`
adds whatever finished files hold beyond what the index covers. Coverage is a
last offset per (topic, partition), saved beside the index in `index.json`; since
a partition's segments tile its offsets, everything up to that offset is in the
index and nothing past it is. Only rows past the coverage are added, so segments
that overlap (written by older versions) still give one entry per record. A
damaged segment stops its partition's coverage (with a warning) until a worker
repairs it; the other partitions go on.

Each vector's id is derived from its record, so the same record can never get
two entries:  id = topic_no << 56 | partition << 40 | offset, with topic_no a
small number per topic fixed in `index.json`.

Sync, rebuild and save take an exclusive lock on `index/.lock`, so several
workers on one output directory take turns; saves write a temp file, fsync and
rename, so a crash leaves the old index or the new one, never half of one.

Index type: exact inner product (IndexFlatIP) over L2-normalised vectors, which
is cosine similarity. It needs no training and stays exact; search cost is
linear in the number of vectors (about 10 ms per query per million 384-d vectors
on a GPU, ~100x that on a CPU core). Past a few million vectors, or when query
latency matters more than the last percent of recall, use an IVF index
(`--index-type ivf`: IVF with sqrt(N)-ish lists, trained on the vectors at
rebuild time, `nprobe` trading recall for speed).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import IndexStateError, OutputError
from sinks.layout import (
    INDEX_META_FILE,
    SegmentFile,
    TopicPartitionKey,
    index_dir,
    segments_by_partition,
)
from sinks.parquet import fsync_dir, output_error
from sinks.segments import DamagedSegment, last_offset, read_rows

log = logging.getLogger(__name__)

_TOPIC_SHIFT = 56
_PARTITION_SHIFT = 40
_MAX_TOPICS = 1 << 7
_MAX_PARTITIONS = 1 << 16
_OFFSET_MASK = (1 << _PARTITION_SHIFT) - 1
INDEX_TYPES = ("flat", "ivf")


def encode_id(topic_no: int, partition: int, offset: int) -> int:
    if not (0 <= topic_no < _MAX_TOPICS and 0 <= partition < _MAX_PARTITIONS):
        raise IndexStateError(f"topic #{topic_no} partition {partition} does not fit an index id")
    if not 0 <= offset <= _OFFSET_MASK:
        raise IndexStateError(f"offset {offset} does not fit an index id")
    return (topic_no << _TOPIC_SHIFT) | (partition << _PARTITION_SHIFT) | offset


def decode_id(vector_id: int) -> tuple[int, int, int]:
    return (
        vector_id >> _TOPIC_SHIFT,
        (vector_id >> _PARTITION_SHIFT) & (_MAX_PARTITIONS - 1),
        vector_id & _OFFSET_MASK,
    )


def _key(topic: str, partition: int) -> str:
    return f"{topic}:{partition}"


@dataclass
class IndexMeta:
    dim: int
    index_type: str = "flat"
    topics: dict[str, int] = field(default_factory=dict)
    covered: dict[str, int] = field(default_factory=dict)  # "topic:partition" -> last offset
    entries: dict[str, int] = field(default_factory=dict)  # "topic:partition" -> vectors
    generation: int = 0
    index_file: str = ""
    model: dict[str, str] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return sum(self.entries.values())

    def topic_no(self, topic: str) -> int:
        if topic not in self.topics:
            self.topics[topic] = len(self.topics)
        return self.topics[topic]

    def to_json(self) -> str:
        data = dict(self.__dict__, count=self.count, updated_at=time.time())
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> IndexMeta:
        data = json.loads(text)
        return cls(
            dim=int(data["dim"]),
            index_type=data.get("index_type", "flat"),
            topics={k: int(v) for k, v in data.get("topics", {}).items()},
            covered={k: int(v) for k, v in data.get("covered", {}).items()},
            entries={k: int(v) for k, v in data.get("entries", {}).items()},
            generation=int(data.get("generation", 0)),
            index_file=str(data.get("index_file", "")),
            model=dict(data.get("model", {})),
        )


@dataclass(frozen=True)
class Hit:
    score: float
    topic: str
    partition: int
    offset: int


class IndexStore:
    """The index of one output directory; loads lazily, syncs from Parquet."""

    def __init__(self, output: Path, use_gpu: bool = False, index_type: str = "flat") -> None:
        self.output = output
        self.directory = index_dir(output)
        self.use_gpu = use_gpu
        self.index_type = index_type
        self._index: Any = None
        self._meta: IndexMeta | None = None
        self.damaged: list[DamagedSegment] = []  # skipped by the last sync or rebuild
        self._warned: set[Path] = set()
        # Topic numbers, generation and file of the index a rebuild replaces.
        self._carried: tuple[dict[str, int], int, str] = ({}, 0, "")

    @property
    def meta(self) -> IndexMeta | None:
        return self._meta

    # -- keeping in step with the Parquet files ---------------------------------

    def sync(self) -> int:
        """Adds the vectors of finished files past the covered offsets; returns how many."""
        self.damaged = []
        with self._locked():
            self._load_if_changed()
            added = self._add_new_segments()
            if added:
                self._save()
            return added

    def rebuild(self) -> int:
        """Builds the index from scratch from every Parquet file; returns the vector count."""
        with self._locked():
            # Topic numbers (and so every id) and the generation carry over, so ids
            # stay stable and a reader holding the old generation sees the change.
            # Only the metadata is read: the old index may be the broken thing.
            try:
                previous = self._saved_meta()
            except IndexStateError:
                previous = None
            self._carried = (
                (dict(previous.topics), previous.generation, previous.index_file)
                if previous
                else ({}, 0, "")
            )
            self._index, self._meta = None, None
            self.damaged = []
            self._add_new_segments(train=self.index_type == "ivf")
            if self._meta is None:
                raise IndexStateError(f"no Parquet files under {self.output}/vectors to index")
            self._save()
            return self._meta.count

    def _add_new_segments(self, train: bool = False) -> int:
        pending = self._pending_segments()
        if not any(pending.values()):
            return 0
        if train:
            self._train_ivf([s.path for segments in pending.values() for s in segments])
        added = 0
        for segments in pending.values():
            for segment in segments:
                try:
                    added += self._add_segment(segment)
                except DamagedSegment as damaged:
                    self._skip_damaged(damaged)
                    break  # coverage stops here until a worker repairs it
                except FileNotFoundError:
                    break  # moved aside meanwhile
        return added

    def _pending_segments(self) -> dict[TopicPartitionKey, list[SegmentFile]]:
        """Per partition, the segments that may hold rows past the index's coverage."""
        covered = self._meta.covered if self._meta else {}
        pending: dict[TopicPartitionKey, list[SegmentFile]] = {}
        for key, segments in segments_by_partition(self.output).items():
            through = covered.get(_key(*key), -1)
            later = [s for s in segments if s.key.first > through]
            earlier = [s for s in segments if s.key.first <= through]
            # The last segment starting inside the coverage may run past it (one
            # written again after its partition's damaged last segment).
            if earlier and self._runs_past(earlier[-1], through):
                later.insert(0, earlier[-1])
            pending[key] = later
        return pending

    def _runs_past(self, segment: SegmentFile, through: int) -> bool:
        try:
            return last_offset(segment) > through
        except (DamagedSegment, FileNotFoundError):
            return False  # not readable now; a worker repairs it

    def _add_segment(self, segment: SegmentFile) -> int:
        table, info = read_rows(segment, ["offset", "embedding"])
        meta = self._ensure(_list_size(table), segment.path)
        key = _key(*segment.key.partition_key)
        through = meta.covered.get(key, -1)
        offsets = table.column("offset").to_numpy().astype(np.int64)
        fresh = offsets > through
        vectors = _vectors(table)[fresh] if len(offsets) else _vectors(table)
        if len(vectors):
            base = encode_id(meta.topic_no(segment.key.topic), segment.key.partition, 0)
            self._index.add_with_ids(np.ascontiguousarray(vectors), base | offsets[fresh])
            meta.entries[key] = meta.entries.get(key, 0) + len(vectors)
        meta.covered[key] = max(through, info.last)
        return len(vectors)

    def _skip_damaged(self, damaged: DamagedSegment) -> None:
        self.damaged.append(damaged)
        if damaged.segment.path not in self._warned:
            self._warned.add(damaged.segment.path)
            log.warning(
                "index: skipping %s and the rest of its partition (%s); a worker starting "
                "moves it aside and reads its records again from Kafka",
                damaged.segment.path.name,
                damaged.reason,
            )

    def _ensure(self, dim: int | None, path: Path) -> IndexMeta:
        if self._meta is None:
            if self.index_type != "flat":
                raise IndexStateError(
                    f"an {self.index_type} index is trained from all the vectors: run "
                    f"pipeline index rebuild --output {self.output} --index-type {self.index_type}"
                )
            self._meta = self._new_meta(dim if dim is not None else _dim_from_schema(path), path)
            self._index = faiss_flat(self._meta.dim)
        elif dim is not None and dim != self._meta.dim:
            raise IndexStateError(
                f"{path.name} has {dim}-d vectors but the index is {self._meta.dim}-d: "
                "one output directory holds one model's vectors"
            )
        return self._meta

    def _new_meta(self, dim: int, path: Path) -> IndexMeta:
        topics, generation, index_file = self._carried
        return IndexMeta(
            dim=dim,
            index_type=self.index_type,
            topics=dict(topics),
            generation=generation,
            index_file=index_file,
            model=_model_meta(path),
        )

    def _train_ivf(self, paths: list[Path]) -> None:
        import faiss

        tables = []
        for path in paths[:200]:
            try:
                tables.append(_vectors(pq.read_table(path, columns=["embedding"])))
            except (OSError, pa.ArrowException):
                continue  # damaged: skipped (with a warning) when the vectors are added
        sample = np.concatenate([t for t in tables if len(t)] or [np.empty((0, 1), np.float32)])
        if len(sample) < 64:
            raise IndexStateError("an IVF index needs at least 64 vectors; use the flat index")
        dim = sample.shape[1]
        nlist = max(1, min(int(np.sqrt(len(sample)) * 4), len(sample) // 39))
        quantizer = faiss.IndexFlatIP(dim)
        ivf = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
        ivf.train(sample)
        ivf.nprobe = max(1, nlist // 16)
        self._meta = self._new_meta(dim, paths[0])
        self._index = faiss.IndexIDMap2(ivf)

    # -- persistence -------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fh = open(self.directory / ".lock", "a+b")  # noqa: SIM115 - held for the block
        except OSError as exc:
            raise OutputError(f"cannot use index directory {self.directory}: {exc}") from exc
        with fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    def _saved_meta(self) -> IndexMeta | None:
        meta_path = self.directory / INDEX_META_FILE
        if not meta_path.exists():
            return None
        try:
            return IndexMeta.from_json(meta_path.read_text())
        except (ValueError, KeyError) as exc:
            raise IndexStateError(
                f"{meta_path} is unreadable ({exc}); run: pipeline index rebuild "
                f"--output {self.output}"
            ) from exc

    def _load_if_changed(self) -> None:
        on_disk = self._saved_meta()
        if on_disk is None:
            self._index, self._meta = None, None
            return
        if self._meta is not None and on_disk.generation == self._meta.generation:
            return
        index = _read_index(self.directory / on_disk.index_file)
        if int(index.ntotal) != on_disk.count:
            raise IndexStateError(
                f"the index in {self.directory} holds {index.ntotal} vectors but its metadata "
                f"says {on_disk.count}; run: pipeline index rebuild --output {self.output}"
            )
        self._index, self._meta = index, on_disk

    def load(self) -> None:
        """Loads the saved index for searching (no sync)."""
        with self._locked():
            self._load_if_changed()
        if self._meta is None:
            raise IndexStateError(
                f"no index in {self.directory}; run a worker or: "
                f"pipeline index rebuild --output {self.output}"
            )

    def _save(self) -> None:
        """Writes index-<generation>.faiss, then switches index.json to it.

        The rename of index.json is the commit point: a crash before it leaves
        the previous metadata pointing at the previous index file, intact.
        """
        import faiss

        assert self._meta is not None
        previous = self._meta.index_file
        self._meta.generation += 1
        self._meta.index_file = f"index-{self._meta.generation:08d}.faiss"
        index_path = self.directory / self._meta.index_file
        meta_tmp = self.directory / f".{INDEX_META_FILE}.{os.getpid()}.tmp"
        try:
            faiss.write_index(self._index, str(index_path))
            _fsync_file(index_path)
            meta_tmp.write_text(self._meta.to_json())
            _fsync_file(meta_tmp)
            os.rename(meta_tmp, self.directory / INDEX_META_FILE)
            fsync_dir(self.directory)
        except OSError as exc:
            index_path.unlink(missing_ok=True)
            meta_tmp.unlink(missing_ok=True)
            raise output_error(exc, index_path) from exc
        if previous and previous != self._meta.index_file:
            (self.directory / previous).unlink(missing_ok=True)

    # -- search ------------------------------------------------------------------

    def search(self, queries: np.ndarray, k: int) -> list[list[Hit]]:
        if self._meta is None:
            self.load()
        assert self._meta is not None
        index = self._search_index()
        scores, ids = index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
        topics = {no: name for name, no in self._meta.topics.items()}
        results: list[list[Hit]] = []
        for row_scores, row_ids in zip(scores, ids, strict=True):
            hits = []
            for score, vector_id in zip(row_scores, row_ids, strict=True):
                if vector_id < 0:
                    continue
                topic_no, partition, offset = decode_id(int(vector_id))
                hits.append(Hit(float(score), topics[topic_no], partition, offset))
            results.append(hits)
        return results

    def _search_index(self) -> Any:
        import faiss

        if self.use_gpu and hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
            return faiss.index_cpu_to_all_gpus(self._index)
        return self._index

    @property
    def ntotal(self) -> int:
        return 0 if self._index is None else int(self._index.ntotal)

    def ids(self) -> np.ndarray:
        """Every id in the index (for checks and status)."""
        import faiss

        if self._index is None:
            return np.empty(0, dtype=np.int64)
        return faiss.vector_to_array(self._index.id_map).astype(np.int64)


def faiss_flat(dim: int) -> Any:
    import faiss

    return faiss.IndexIDMap2(faiss.IndexFlatIP(dim))


def _vectors(table: Any) -> np.ndarray:
    column = table.column("embedding").combine_chunks()
    if len(column) == 0:
        return np.empty((0, 0), dtype=np.float32)
    dim = column.type.list_size
    return column.values.to_numpy(zero_copy_only=False).reshape(-1, dim).astype(np.float32)


def _list_size(table: Any) -> int | None:
    if table.num_rows == 0:
        return None
    return int(table.schema.field("embedding").type.list_size)


def _dim_from_schema(path: Path) -> int:
    return int(pq.read_schema(path).field("embedding").type.list_size)


def _model_meta(path: Path) -> dict[str, str]:
    raw = pq.read_schema(path).metadata or {}
    return {
        k.decode()[len("embedding.") :]: v.decode()
        for k, v in raw.items()
        if k.startswith(b"embedding.")
    }


def _read_index(path: Path) -> Any:
    import faiss

    try:
        return faiss.read_index(str(path))
    except RuntimeError as exc:
        raise IndexStateError(
            f"cannot read the index {path}: {exc}; run: pipeline index rebuild"
        ) from exc


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
