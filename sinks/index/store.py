"""FAISS index over the Parquet files, kept in step with them.

The index is derived data: the Parquet files are the truth, and `IndexStore.sync()`
adds whatever finished files hold beyond what the index covers. Coverage is a
last offset per (topic, partition), saved in `index.json`; since a partition's
segments tile its offsets, everything up to that offset is in the index and
nothing past it is. Only rows past the coverage are added, so segments that
overlap (written by older versions) still give one entry per record. A damaged
segment stops its partition's coverage (with a warning) until a worker repairs
it; the other partitions go on.

A sync writes the new vectors as new shard files and never loads the index (see
sinks.index.shards): a worker's index upkeep costs what its new vectors cost,
however large the corpus. Readers add the shards up when they load.

Each vector's id is derived from its row, so the same row can never get two
entries:  id = topic_no << 56 | partition << 40 | offset, with topic_no a small
number per topic fixed in `index.json`. An output of chunks (several rows per
offset, a `chunk` column) gets the chunked layout, topic_no << 56 | partition << 44
| offset << 8 | chunk, chosen when the index is made from its first segment and
recorded in `index.json` as `chunks` (sinks.index.ids.IdLayout).

Sync, rebuild and load take an exclusive lock on `index/.lock`, so several
workers on one output directory take turns and a reader never meets a shard
that a merge is removing. On an object store writers race instead, and the
loser of a commit syncs again from the winner's list (see sinks.index.files).

The index searches by the model's similarity (sinks.index.metric: cosine as an
inner product over L2-normalised copies of the vectors, dot, euclidean, manhattan),
taken from the segments' `embedding.similarity` when the index is made and kept in
`index.json`; search gives scores as SentenceTransformer.similarity does.

Index types (`flat`, exact; `ivf` and `ivf-pq`, trained at `pipeline index rebuild`,
later vectors in flat shards beside them): docs/exactly-once.md, the index.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from pipeline.core.chunks import CHUNK
from pipeline.core.documents import DELETED
from pipeline.core.errors import IndexStateError, OutputError
from pipeline.core.layout import (
    Output,
    SegmentFile,
    TopicPartitionKey,
    describe,
    iter_segments,
    segments_by_partition,
)
from pipeline.core.retry import retry
from sinks.index import metric as metrics
from sinks.index.files import index_files
from sinks.index.flat_files import faiss_flat, flat_file_bytes, merge_flat_files
from sinks.index.ids import ChunksInPlainIndex, IdLayout, decode_id, encode_id, row_chunks
from sinks.index.removed import Removals
from sinks.index.shards import (
    FLAT,
    INDEX_TYPES,
    FileNames,
    FlatShardWriter,
    IndexMeta,
    Shard,
    SyncStats,
    VectorSink,
    cap_vectors,
    contents,
    ids_of,
    next_merge,
    read_index_file,
    table_vectors,
    write_checked,
)
from sinks.index.trained import TrainedBuilder, trained_builder
from sinks.segments import DamagedSegment, read_rows, read_schema, segments_past, with_vectors

__all__ = [
    "INDEX_TYPES",
    "Hit",
    "IdLayout",
    "IndexMeta",
    "IndexStore",
    "SyncStats",
    "decode_id",
    "encode_id",
]

log = logging.getLogger(__name__)

# Commits a sync may lose in a row to other writers before it gives up (object stores);
# the backoff grows, so a loaded machine with several writers still gets through.
_COMMIT_ATTEMPTS = 20
# The largest k FAISS's GPU indexes search for (GPU_MAX_SELECTION_K).
_GPU_MAX_K = 2048


def _commit_pause(tries: int) -> float:  # random: writers that lost together part
    return random.uniform(0.05, 0.5) * min(tries, 10)


T = TypeVar("T")


def _key(topic: str, partition: int) -> str:
    return f"{topic}:{partition}"


@dataclass(frozen=True)
class Hit:
    score: float
    topic: str
    partition: int
    offset: int
    chunk: int = 0  # the row of the offset, in an output of chunks (0 otherwise)

    @property
    def place(self) -> tuple[str, int, int]:
        """The record: (topic, partition, offset)."""
        return self.topic, self.partition, self.offset


class IndexStore(Removals):
    """The index of one output directory: syncs from Parquet, loads for search."""

    def __init__(
        self,
        output: Output,
        use_gpu: bool = False,
        index_type: str = FLAT,
        shard_cap: int | None = None,
        similarity: str | None = None,
    ) -> None:
        """`similarity`: what an index made here (a rebuild, or the first sync) searches
        by; None: the one the segments record (sinks.index.metric: none recorded, an
        inner product over the stored vectors, as before it was recorded)."""
        if index_type not in INDEX_TYPES:
            raise IndexStateError(f"unknown index type {index_type!r}; one of {INDEX_TYPES}")
        self.output = output
        self.files = index_files(output)
        self.directory = self.files.directory  # where shard files are written and read
        # Writers that do not take turns (object stores) name shards apart.
        self._tag = "" if isinstance(output, Path) else f"-{os.urandom(4).hex()}"
        self.use_gpu = use_gpu
        self.index_type = index_type
        self.shard_cap = shard_cap  # vectors per shard; None: from SHARD_CAP_BYTES
        self._index: Any = None  # loaded for search only; a sync never loads it
        self._gpu_copy: tuple[Any, Any] | None = None  # (the loaded index, its GPU copy)
        self._meta: IndexMeta | None = None
        self.damaged: list[DamagedSegment] = []  # skipped by the last sync or rebuild
        self.last_sync = SyncStats()
        self._warned: set[str] = set()
        self._carried_topics: dict[str, int] = {}  # a rebuild keeps every id
        self.similarity = metrics.checked(similarity, "--similarity")
        self._new_similarity: str | None = None  # what a new index searches by, once known
        self._new_resolved = False
        self._new_chunks = False  # a rebuild's new index: chunked whatever its first segment

    @property
    def meta(self) -> IndexMeta | None:
        return self._meta

    # -- keeping in step with the Parquet files ---------------------------------

    def sync(self) -> int:
        """Adds the vectors of finished files past the covered offsets; returns how many."""
        return self._until_committed(self._sync_once)

    def _sync_once(self, stats: SyncStats) -> None:
        self.damaged = []
        self._new_resolved = False  # an output without vectors yet records nothing
        with self.files.locked():
            self._meta = self._read_meta()
            generation = self._meta.generation if self._meta else 0
            covered = dict(self._meta.covered) if self._meta else {}
            names = FileNames(generation + 1, self._tag)
            metric = self._meta.metric if self._meta else self._metric_for_new()
            writer = FlatShardWriter(self.directory, names, self.shard_cap, stats, metric)
            stats.added = self._add_new_segments(writer, FLAT)
            new = writer.finish()
            if self._meta is not None and (new or self._meta.covered != covered):
                self._meta.shards.extend(new)
                self._merge_small(self._meta, names, stats)
                self._commit(self._meta, names.generation, stats)

    def _until_committed(self, attempt: Callable[[SyncStats], None]) -> int:
        """Runs a sync or rebuild until its commit wins (at once, where writers take turns)."""
        started = time.perf_counter()

        def once() -> SyncStats:
            stats = SyncStats()
            try:
                attempt(stats)
            except _LostCommit:
                self._meta = None  # read again by the next try
                raise
            return stats

        try:
            stats = retry(once, on=_LostCommit, attempts=_COMMIT_ATTEMPTS, pause=_commit_pause)
        except _LostCommit:
            raise OutputError(
                f"the index at {self.files.where} changed under {_COMMIT_ATTEMPTS} commits in a "
                "row; too many writers syncing at once: try again"
            ) from None
        stats.seconds = time.perf_counter() - started
        self.last_sync = stats
        return stats.added

    def rebuild(self) -> int:
        """Builds the index from scratch from every Parquet file; returns the vector count."""
        self._until_committed(self._rebuild_once)
        assert self._meta is not None
        return self._meta.count

    def _rebuild_once(self, stats: SyncStats) -> None:
        with self.files.locked():
            # Topic numbers (and so every id) and the generation carry over, so ids
            # stay stable and a reader holding the old generation sees the change.
            # Only the metadata is read: the old shards may be the broken thing.
            try:
                previous = self.saved_meta()
            except IndexStateError:
                previous = None
            self._carried_topics = dict(previous.topics) if previous else {}
            names = FileNames((previous.generation if previous else 0) + 1, self._tag)
            chunks = previous.chunks if previous else False
            try:
                meta = self._build(names, stats, chunks)
            except ChunksInPlainIndex:
                # Rows of chunks past a first segment without them: the index is made
                # chunked (the files already written go with the commit's tidy-up).
                stats.shards_written = stats.bytes_written = 0
                meta = self._build(names, stats, True)
            if previous is not None:  # removed versions stay removed
                meta.removed = self.carried_removals(previous, meta, names, stats)
            self._commit(meta, names.generation, stats)

    def _build(self, names: FileNames, stats: SyncStats, chunks: bool) -> IndexMeta:
        """A new index of every Parquet file, its files written, not committed; chunked
        where `chunks` or the first segment holds chunks."""
        self._index, self._meta, self.damaged = None, None, []
        self._new_resolved, self._new_chunks = False, chunks
        similarity = self._similarity_for_new()
        metrics.check_index_type(self.index_type, similarity)
        shared = (self.directory, names, stats)
        # A flat rebuild writes one file, as readers load one file fastest:
        # like them, it holds the whole index in memory (a worker never does).
        cap, metric = self.shard_cap or sys.maxsize, metrics.faiss_metric(similarity)
        sink: VectorSink = (
            FlatShardWriter(self.directory, names, cap, stats, metric)
            if self.index_type == FLAT
            else trained_builder(
                self.index_type, list(iter_segments(self.output)), *shared, similarity
            )
        )
        stats.added = self._add_new_segments(sink, self.index_type)
        if self._meta is None:
            raise IndexStateError(
                f"no Parquet files under {describe(self.output)}/vectors to index"
            )
        self._meta.shards = sink.finish()
        if isinstance(sink, TrainedBuilder):
            self._meta.recall_at_10 = sink.recall_at_10()
        return self._meta

    def _merge_cap(self, dim: int) -> int:
        return self.shard_cap if self.shard_cap is not None else cap_vectors(dim)

    def _add_new_segments(self, sink: VectorSink, index_type: str) -> int:
        added = 0
        for segments in self._pending_segments().values():
            for segment in segments:
                try:
                    added += self._add_segment(segment, sink, index_type)
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
            pending[key] = segments_past(segments, covered.get(_key(*key), -1))
        return pending

    def _add_segment(self, segment: SegmentFile, sink: VectorSink, index_type: str) -> int:
        table, info = read_rows(segment, ["offset", "embedding"], optional=[DELETED, CHUNK])
        chunked = CHUNK in table.column_names
        meta = self._ensure(_list_size(table), segment, index_type, chunked)
        key = _key(*segment.key.partition_key)
        through = meta.covered.get(key, -1)
        offsets = table.column("offset").to_numpy().astype(np.int64)
        fresh = (offsets > through) & with_vectors(table)
        vectors = table_vectors(table)[fresh] if len(offsets) else table_vectors(table)
        vectors = metrics.prepare(vectors, meta.similarity)
        if len(vectors):
            chunks = row_chunks(table)[fresh] if chunked else None
            topic_no = meta.topic_no(segment.key.topic)
            ids = meta.layout.encode_many(topic_no, segment.key.partition, offsets[fresh], chunks)
            sink.add(vectors, ids)
            meta.entries[key] = meta.entries.get(key, 0) + len(vectors)
        meta.covered[key] = max(through, info.last)
        return len(vectors)

    def _skip_damaged(self, damaged: DamagedSegment) -> None:
        self.damaged.append(damaged)
        if damaged.segment.name not in self._warned:
            self._warned.add(damaged.segment.name)
            log.warning(
                "index: skipping %s and the rest of its partition (%s); a worker starting "
                "moves it aside and reads its records again from Kafka",
                damaged.segment.name,
                damaged.reason,
            )

    def _ensure(
        self, dim: int | None, segment: SegmentFile, index_type: str, chunked: bool = False
    ) -> IndexMeta:
        """The index's metadata; made from `segment` (the first one) if there is none
        yet: chunked ids where that segment holds chunks (`chunked`), or a rebuild asks."""
        if self._meta is None:
            schema = read_schema(segment)
            self._meta = IndexMeta(
                dim=dim if dim is not None else int(schema.field("embedding").type.list_size),
                index_type=index_type,
                topics=dict(self._carried_topics),
                model=_model_meta(schema.metadata),
                similarity=self._similarity_for_new(),
                chunks=chunked or self._new_chunks,
            )
        elif dim is not None and dim != self._meta.dim:
            raise IndexStateError(
                f"{segment.name} has {dim}-d vectors but the index is {self._meta.dim}-d: "
                "one output directory holds one model's vectors"
            )
        return self._meta

    def _similarity_for_new(self) -> str | None:
        """What a new index searches by: the store's `similarity`, else the one the
        output's segments record (its newest footers), else None (none recorded)."""
        if not self._new_resolved:
            from sinks.identity import recorded_model

            found = self.similarity
            if found is None:
                recorded = (recorded_model(self.output) or {}).get("similarity") or None
                found = metrics.checked(recorded, f"{describe(self.output)}: embedding.similarity")
            self._new_similarity, self._new_resolved = found, True
        return self._new_similarity

    def _metric_for_new(self) -> int:
        return metrics.faiss_metric(self._similarity_for_new())

    def _merge_small(self, meta: IndexMeta, names: FileNames, stats: SyncStats) -> None:
        """Merges tiers of small flat shards (see sinks.index.shards); bounded by the cap."""
        cap = self._merge_cap(meta.dim)
        while group := next_merge(meta.shards, cap):
            name = names.next()
            size = self._merge_streaming(group, self.directory / name, meta)
            if size is None:
                merged = faiss_flat(meta.dim, meta.metric)
                for shard in group:
                    vectors, ids = contents(self._read_shard(shard, meta))
                    merged.add_with_ids(vectors, ids)
                size = write_checked(merged, self.directory / name)
            stats.bytes_written += size
            stats.shards_merged += len(group)
            meta.shards = [s for s in meta.shards if s not in group]
            meta.shards.append(Shard(name, sum(s.count for s in group)))

    def _merge_streaming(self, group: list[Shard], target: Path, meta: IndexMeta) -> int | None:
        """The merged shard written from the files' bytes (sinks.index.flat_files), or None
        where they must go through faiss."""
        sources = [(self.files.fetch(s.file), s.count) for s in group]
        try:
            return merge_flat_files(sources, target, meta.dim, meta.metric)
        finally:
            for shard in group:
                self.files.release(shard.file)

    # -- persistence -------------------------------------------------------------

    def saved_meta(self) -> IndexMeta | None:
        """What index.json says (None: no index yet), its files unchecked."""
        text = self.files.meta_text()
        if text is None:
            return None
        try:
            return IndexMeta.from_json(text)
        except (ValueError, KeyError, TypeError) as exc:
            raise IndexStateError(
                f"the index metadata in {self.files.where} is unreadable ({exc}); "
                f"run: pipeline index rebuild --output {describe(self.output)}"
            ) from exc

    def _read_meta(self) -> IndexMeta | None:
        """The saved metadata, checked against its files without reading them."""
        meta = self.saved_meta()
        if meta is None:
            return None
        rebuild = f"run: pipeline index rebuild --output {describe(self.output)}"
        if meta.shard_total != meta.count:
            raise IndexStateError(
                f"the index in {self.files.where} holds {meta.shard_total} vectors but its "
                f"metadata says {meta.count}; {rebuild}"
            )
        sizes = self.files.sizes()
        for shard in meta.shards:
            where = f"{self.files.where}/{shard.file}"
            size = sizes.get(shard.file)
            if size is None:
                raise IndexStateError(f"the index file {where} is missing; {rebuild}")
            expected = flat_file_bytes(meta.dim, shard.count, meta.metric)
            if shard.kind == FLAT and size != expected:
                raise IndexStateError(
                    f"the index file {where} is {size} bytes, not the {expected} of the "
                    f"{shard.count} vectors its metadata says it holds: damaged or replaced; "
                    f"{rebuild}"
                )
        return meta

    def _commit(self, meta: IndexMeta, generation: int, stats: SyncStats) -> None:
        """Switches to the new list of shards (their files are already written), then
        removes the files no list names any more. A crash before the switch leaves
        the previous list naming the previous files, intact."""
        meta.generation = generation
        text = meta.to_json()
        if not self.files.commit(text, generation, meta.files):
            raise _LostCommit
        stats.bytes_written += len(text)
        self.files.remove_unlisted(set(meta.files))

    def remove_history(self) -> None:
        """Removes the earlier generations' files now (erasure: they hold the vectors of
        erased versions), not after the grace period readers get otherwise."""
        with self.files.locked():
            meta = self.saved_meta()
            if meta is not None:
                self.files.remove_history(set(meta.files))

    def _read_shard(self, shard: Shard, meta: IndexMeta) -> Any:
        try:
            index = read_index_file(self.files.fetch(shard.file), shard.count, meta.metric)
        except IndexStateError as exc:
            raise IndexStateError(
                f"{exc}; run: pipeline index rebuild --output {describe(self.output)}"
            ) from None
        self.files.release(shard.file)
        return index

    # -- reading -----------------------------------------------------------------

    def load(self) -> None:
        """Loads the saved index for searching (no sync): every shard, added up."""
        self._meta = self._reading(self._load_once)

    def _load_once(self) -> IndexMeta:
        meta = self._read_meta()
        if meta is None:
            raise IndexStateError(
                f"no index in {self.files.where}; run a worker or: "
                f"pipeline index rebuild --output {describe(self.output)}"
            )
        loaded = self._meta.generation if self._index is not None and self._meta else None
        if loaded != meta.generation:
            self._index = self._assemble(meta)
        return meta

    def _reading(self, read: Callable[[], T]) -> T:
        """Runs `read` under the lock; where writers do not take turns, a shard removed
        under it (a newer list no longer names it) means reading the newest list."""
        for tries in range(_COMMIT_ATTEMPTS):
            with self.files.locked():
                try:
                    return read()
                except FileNotFoundError:
                    if tries == _COMMIT_ATTEMPTS - 1:
                        raise
        raise AssertionError("unreachable")

    def _assemble(self, meta: IndexMeta) -> Any:
        """The first file (the trained one, if any) with every other shard added at once."""
        if not meta.shards:
            return faiss_flat(meta.dim, meta.metric)
        first, *rest = meta.shards
        index = self._read_shard(first, meta)
        parts = [contents(self._read_shard(s, meta)) for s in rest]
        if parts:
            vectors = np.concatenate([v for v, _ in parts])
            ids = np.concatenate([i for _, i in parts])
            parts.clear()
            index.add_with_ids(vectors, ids)
        if meta.removed:
            import faiss

            index.remove_ids(faiss.IDSelectorBatch(self.removed_ids(meta)))
        return index

    def ids(self) -> np.ndarray:
        """Every id in the saved index, read from its files (for checks and status)."""
        return self.snapshot()[1]

    def snapshot(self) -> tuple[IndexMeta | None, np.ndarray, int]:
        """The saved metadata, every id and the files' bytes, of one generation."""
        return self._reading(self._snapshot_once)

    def _snapshot_once(self) -> tuple[IndexMeta | None, np.ndarray, int]:
        meta = self._read_meta()
        if meta is None:
            return None, np.empty(0, dtype=np.int64), 0
        sizes = self.files.sizes()
        parts = [ids_of(self._read_shard(s, meta)) for s in meta.shards]
        size = sum(sizes.get(name, 0) for name in meta.files)
        ids = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        if meta.removed:  # the ids it serves
            ids = ids[~np.isin(ids, self.removed_ids(meta))]
        return meta, ids, size

    @property
    def ntotal(self) -> int:
        if self._index is not None:
            return int(self._index.ntotal)
        return self._meta.shard_total if self._meta else 0

    def search(self, queries: np.ndarray, k: int, legacy_as: str | None = None) -> list[list[Hit]]:
        """The k nearest of each query (the model's vectors, as stored), by the index's
        similarity, scored as SentenceTransformer.similarity scores. `legacy_as`: the
        similarity an index from before it was recorded answers (metrics.legacy_answers;
        None: its raw inner products)."""
        if self._index is None:
            self.load()
        assert self._meta is not None
        similarity = self._meta.similarity
        if similarity is metrics.LEGACY:
            similarity = legacy_as
        index = self._search_index(k)
        found, ids = index.search(metrics.prepare(queries, similarity), k)
        scores = metrics.scores(found, similarity)
        topics = {no: name for name, no in self._meta.topics.items()}
        layout = self._meta.layout
        results: list[list[Hit]] = []
        for row_scores, row_ids in zip(scores, ids, strict=True):
            hits = []
            for score, vector_id in zip(row_scores, row_ids, strict=True):
                if vector_id < 0:
                    continue
                topic_no, partition, offset, chunk = layout.decode(int(vector_id))
                hits.append(Hit(float(score), topics[topic_no], partition, offset, chunk))
            results.append(hits)
        return results

    def _search_index(self, k: int) -> Any:
        """The loaded index, copied to the GPUs once where asked and able (FAISS's GPU
        search takes k up to _GPU_MAX_K: past it, a search, as a chunked output's
        search for k documents may need, runs on the CPU)."""
        import faiss

        if not self.use_gpu or k > _GPU_MAX_K:
            return self._index
        if self._gpu_copy is not None and self._gpu_copy[0] is self._index:
            return self._gpu_copy[1]
        if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
            try:
                self._gpu_copy = (self._index, faiss.index_cpu_to_all_gpus(self._index))
                return self._gpu_copy[1]
            except RuntimeError as exc:  # a metric this faiss has no GPU kernel for (L1 IVF)
                log.info("index: searching on the CPU (%s)", str(exc).splitlines()[0])
        return self._index


def _list_size(table: Any) -> int | None:
    return int(table.schema.field("embedding").type.list_size) if table.num_rows else None


class _LostCommit(Exception):
    """Another writer committed the generation this one meant to (object stores)."""


def _model_meta(raw: Mapping[bytes, bytes] | None) -> dict[str, str]:
    items = (raw or {}).items()
    return {
        k.decode().removeprefix("embedding."): v.decode()
        for k, v in items
        if k.startswith(b"embedding.")
    }
