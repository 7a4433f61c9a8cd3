"""Ids the index no longer serves: in upsert mode, versions the current view has
superseded or deleted (sinks.view records them as it applies a change).

Shard files are written once and never edited, so a removal is a small file of ids
(`removed-<generation>-<seq>.npy`, sorted int64) listed in index.json beside the
shards; readers leave those ids out when they load. An id once removed is never
served again: a version the view superseded stays superseded, so the order in
which a removal and the vector it removes reach the index does not matter. A purge
(sinks.purge) erases the vectors themselves and drops the removals it made moot.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from sinks.index.shards import FileNames, IndexMeta, Shard, SyncStats, encode_id, ids_of

REMOVED = "removed"  # the kind of a removal file's entry in index.json
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

    def remove(self, places: Iterable[tuple[str, int, int]]) -> int:
        """Stops serving the vectors of these (topic, partition, offset)s, whether the
        index holds them yet or not (sinks.index.removed); returns how many."""
        places = list(places)
        if not places:
            return 0
        if self.saved_meta() is None:
            self.sync()  # the index starts from the segments, as a worker's first sync does
        self._until_committed(lambda stats: self._remove_once(places, stats))
        return len(places)

    def _remove_once(self, places: list[tuple[str, int, int]], stats: SyncStats) -> None:
        with self.files.locked():
            self._meta = meta = self._read_meta()
            if meta is None:
                return  # no segment yet, so no vector to stop serving
            ids = np.fromiter(
                (encode_id(meta.topic_no(t), p, o) for t, p, o in places), np.int64, len(places)
            )
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

    def _read_removed(self, entry: Shard) -> np.ndarray:
        ids = read_ids(self.files.fetch(entry.file))
        self.files.release(entry.file)
        return ids

    def removed_ids(self, meta: IndexMeta) -> np.ndarray:
        return union(map(self._read_removed, meta.removed))
