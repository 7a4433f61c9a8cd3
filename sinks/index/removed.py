"""Ids the index no longer serves: in upsert mode, versions the current view has
superseded or deleted (sinks.view records them as it applies a change).

Shard files are written once and never edited, so a removal is a small file of ids
(`removed-<generation>-<seq>.npy`, sorted int64) listed in index.json beside the
shards; readers leave those ids out when they load. An id once removed is never
served again: a version the view superseded stays superseded, so the order in
which a removal and the vector it removes reach the index does not matter. A purge
(sinks.purge) erases the vectors themselves and drops the removals it made moot.

In an output of chunks (IndexMeta.chunks) a record's version is several vectors, one
per chunk: `remove` then needs each record's chunk count (its rows' `chunk_count`)
and stops serving chunks 0..count-1, or `remove_chunks` takes the rows themselves.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.errors import IndexStateError
from sinks.index.shards import FileNames, IndexMeta, Shard, SyncStats, ids_of

REMOVED = "removed"  # the kind of a removal file's entry in index.json
Place = tuple[str, int, int]  # (topic, partition, offset): a record
ChunkPlace = tuple[str, int, int, int]  # (topic, partition, offset, chunk): one row of it
# Removal files kept apart before they are merged into one (a merge costs every id).
MAX_FILES = 16


def removed_name(generation: int, seq: int, tag: str = "") -> str:
    return f"removed-{generation:08d}-{seq:04d}{tag}.npy"


def write_ids(path: Path, ids: np.ndarray) -> int:
    """Writes and fsyncs sorted unique ids; returns the file's size."""
    with open(path, "wb") as fh:
        np.save(fh, np.unique(ids.astype(np.int64)), allow_pickle=False)
        fh.flush()
        os.fsync(fh.fileno())
        return os.fstat(fh.fileno()).st_size


def read_ids(path: Path) -> np.ndarray:
    return np.load(path, allow_pickle=False).astype(np.int64, copy=False)


def union(parts: Iterable[np.ndarray]) -> np.ndarray:
    arrays = [p for p in parts if len(p)]
    return np.unique(np.concatenate(arrays)) if arrays else np.empty(0, dtype=np.int64)


class Removals:
    """The removal half of sinks.index.store.IndexStore (a base of it): what it writes
    and reads of removal files, under the store's lock and commit."""

    # Provided by IndexStore.
    files: Any
    directory: Path
    _tag: str
    _meta: IndexMeta | None
    saved_meta: Callable[[], IndexMeta | None]
    sync: Callable[[], int]
    _read_meta: Callable[[], IndexMeta | None]
    _until_committed: Callable[[Callable[[SyncStats], None]], int]
    _commit: Callable[[IndexMeta, int, SyncStats], None]
    _read_shard: Callable[[Shard, IndexMeta], Any]

    def remove(self, places: Iterable[Place], chunk_counts: Iterable[int] | None = None) -> int:
        """Stops serving the vectors of these records (topic, partition, offset), whether
        the index holds them yet or not; returns how many records.

        `chunk_counts`: in step with `places`, how many chunks each record's version
        has (its rows' `chunk_count`, >= 1; a deletion row's is 1): every chunk
        0..count-1 stops being served. Required where the index is chunked (an output
        of chunks: IndexMeta.chunks), refused there when None (IndexStateError), since
        a record's other chunks would stay served; in a plain index each count must
        be 1 (None: all 1)."""
        places = list(places)
        counts = None if chunk_counts is None else [int(c) for c in chunk_counts]
        if counts is not None and len(counts) != len(places):
            raise IndexStateError(f"{len(counts)} chunk counts for {len(places)} records")
        if counts is not None and any(c < 1 for c in counts):
            raise IndexStateError(f"a chunk count below 1 ({min(counts)}): nothing to remove")
        if not places:
            return 0
        self._removing(lambda meta: _record_ids(meta, places, counts))
        return len(places)

    def remove_chunks(self, places: Iterable[ChunkPlace]) -> int:
        """Stops serving the vectors of these rows (topic, partition, offset, chunk),
        whether the index holds them yet or not; returns how many. In a plain index
        every chunk must be 0 (IndexStateError otherwise)."""
        places = list(places)
        if not places:
            return 0
        self._removing(lambda meta: _chunk_ids(meta, places))
        return len(places)

    def _removing(self, ids_of_places: Callable[[IndexMeta], np.ndarray]) -> None:
        if self.saved_meta() is None:
            self.sync()  # the index starts from the segments, as a worker's first sync does
        self._until_committed(lambda stats: self._remove_once(ids_of_places, stats))

    def _remove_once(
        self, ids_of_places: Callable[[IndexMeta], np.ndarray], stats: SyncStats
    ) -> None:
        with self.files.locked():
            self._meta = meta = self._read_meta()
            if meta is None:
                return  # no segment yet, so no vector to stop serving
            ids = ids_of_places(meta)
            names = FileNames(meta.generation + 1, self._tag)
            if len(meta.removed) >= MAX_FILES:  # merged, so readers open few
                ids = union([ids, *map(self._read_removed, meta.removed)])
                meta.removed = []
            name = removed_name(names.generation, len(meta.removed), self._tag)
            size = write_ids(self.directory / name, ids)
            meta.removed.append(Shard(name, len(np.unique(ids)), REMOVED))
            stats.bytes_written += size
            self._commit(meta, names.generation, stats)

    def prune_removed(self) -> int:
        """Forgets the removals of ids no shard holds (a purge erased their vectors);
        returns how many are kept."""
        return self._until_committed(self._prune_once)

    def _prune_once(self, stats: SyncStats) -> None:
        with self.files.locked():
            self._meta = meta = self._read_meta()
            if meta is None or not meta.removed:
                return
            held = np.concatenate([ids_of(self._read_shard(s, meta)) for s in meta.shards] or [
                np.empty(0, dtype=np.int64)])  # fmt: skip
            ids = union(map(self._read_removed, meta.removed))
            kept = ids[np.isin(ids, held)]
            names = FileNames(meta.generation + 1, self._tag)
            meta.removed = []
            if len(kept):
                name = removed_name(names.generation, 0, self._tag)
                write_ids(self.directory / name, kept)
                meta.removed.append(Shard(name, len(kept), REMOVED))
            stats.added = len(kept)
            self._commit(meta, names.generation, stats)

    def carried_removals(
        self, previous: IndexMeta, meta: IndexMeta, names: FileNames, stats: SyncStats
    ) -> list[Shard]:
        """The removals of `previous` for `meta`, a rebuild of it: as they are, or (a plain
        index rebuilt chunked) their ids in the new layout, in one new file."""
        if previous.chunks == meta.chunks or not previous.removed:
            return list(previous.removed)
        moved = meta.layout.encode_many(*previous.layout.decode_many(self.removed_ids(previous)))
        name = removed_name(names.generation, 0, self._tag)
        stats.bytes_written += write_ids(self.directory / name, moved)
        return [Shard(name, len(np.unique(moved)), REMOVED)]

    def _read_removed(self, entry: Shard) -> np.ndarray:
        ids = read_ids(self.files.fetch(entry.file))
        self.files.release(entry.file)
        return ids

    def removed_ids(self, meta: IndexMeta) -> np.ndarray:
        return union(map(self._read_removed, meta.removed))


def _record_ids(
    meta: IndexMeta, places: Sequence[Place], counts: Sequence[int] | None
) -> np.ndarray:
    """The ids of every chunk of these records' versions (see Removals.remove)."""
    if counts is None:
        if meta.chunks:
            raise IndexStateError(
                "the index holds chunks (several vectors a record): a removal names how many "
                "chunks each record has (Removals.remove's chunk_counts)"
            )
        counts = [1] * len(places)
    reps = np.asarray(counts, dtype=np.int64)
    starts = np.cumsum(reps) - reps
    chunks = np.arange(int(reps.sum()), dtype=np.int64) - np.repeat(starts, reps)
    topics, partitions, offsets = _columns(meta, places)
    return meta.layout.encode_many(
        np.repeat(topics, reps), np.repeat(partitions, reps), np.repeat(offsets, reps), chunks
    )


def _chunk_ids(meta: IndexMeta, places: Sequence[ChunkPlace]) -> np.ndarray:
    """The ids of these rows (see Removals.remove_chunks)."""
    topics, partitions, offsets = _columns(meta, [p[:3] for p in places])
    chunks = np.fromiter((p[3] for p in places), np.int64, len(places))
    return meta.layout.encode_many(topics, partitions, offsets, chunks)


def _columns(meta: IndexMeta, places: Sequence[Place]) -> tuple[np.ndarray, ...]:
    n = len(places)
    return (
        np.fromiter((meta.topic_no(t) for t, _, _ in places), np.int64, n),
        np.fromiter((p for _, p, _ in places), np.int64, n),
        np.fromiter((o for _, _, o in places), np.int64, n),
    )
