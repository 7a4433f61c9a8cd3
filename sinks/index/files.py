"""Where the index's files live, and how a new list of shards is committed.

The index (sinks.index.store) writes and reads shard files in a local directory
and commits a new list of them; this module says what that means on each kind
of output:

- `LocalIndexFiles`, a directory: shards are written in place, `index.json` is
  replaced by a rename (the commit point), and an exclusive flock on
  `index/.lock` makes writers take turns and keeps readers off files a merge
  removes.
- `ObjectIndexFiles`, an object store: there is no rename and no lock shared by
  machines. The list is a manifest `index/manifest-<generation>.json`, created
  with a create-if-absent PUT: of writers committing the same generation exactly
  one wins, the others are told (`commit` returns False) and start their sync
  again from the winner's list. Shard names carry the writer's token, so racing
  writers never share one; shards are uploaded before the manifest naming them.
  Readers take the highest generation. Shards are written and read through a
  local scratch directory, each copy dropped once uploaded or read. Files no
  recent manifest names are deleted once older than a grace period, so that a
  slow reader of the previous generation, or a writer about to commit, keeps its
  files; a reader that still finds one gone reads the newest list again.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pipeline.core.errors import OutputError
from pipeline.core.host import process_alive
from pipeline.core.layout import INDEX_DIR, INDEX_META_FILE, Output, describe, index_dir
from sinks.index.shards import IndexMeta, is_index_file

if TYPE_CHECKING:
    from sinks.objectstore import ObjectInfo, ObjectStore

log = logging.getLogger(__name__)

_MANIFEST = re.compile(r"^manifest-(\d{20})\.json$")
# Manifests kept besides the newest; their shards are kept too.
KEEP_MANIFESTS = 4
# Unlisted files younger than this are kept: a writer may be about to list them,
# a reader may still be reading them. (A live sync takes seconds.)
GRACE_S = 15 * 60


class IndexFiles(Protocol):
    directory: Path  # where shard files are written, and read from (`fetch`)
    where: str  # the index's location, for messages

    def locked(self) -> contextlib.AbstractContextManager[None]: ...

    def meta_text(self) -> str | None: ...

    def sizes(self) -> dict[str, int]: ...

    def fetch(self, name: str) -> Path: ...

    def release(self, name: str) -> None: ...

    def commit(self, text: str, generation: int, shards: list[str]) -> bool: ...

    def remove_unlisted(self, listed: set[str]) -> None: ...

    def remove_history(self, listed: set[str]) -> None: ...


def index_files(output: Output) -> IndexFiles:
    if isinstance(output, Path):
        return LocalIndexFiles(index_dir(output))
    return ObjectIndexFiles(output)


class LocalIndexFiles:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.where = str(directory)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
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

    def meta_text(self) -> str | None:
        try:
            return (self.directory / INDEX_META_FILE).read_text()
        except FileNotFoundError:
            return None

    def sizes(self) -> dict[str, int]:
        if not self.directory.is_dir():
            return {}
        return {
            entry.name: entry.stat().st_size
            for entry in os.scandir(self.directory)
            if is_index_file(entry.name)
        }

    def fetch(self, name: str) -> Path:
        return self.directory / name

    def release(self, name: str) -> None:
        pass  # the file is the index itself

    def commit(self, text: str, generation: int, shards: list[str]) -> bool:
        """Replaces index.json (shards are already written and fsynced). Always True:
        writers take turns under the lock."""
        from sinks.parquet import fsync_dir, output_error

        meta_tmp = self.directory / f".{INDEX_META_FILE}.{os.getpid()}.tmp"
        try:
            meta_tmp.write_text(text)
            with open(meta_tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.rename(meta_tmp, self.directory / INDEX_META_FILE)
            fsync_dir(self.directory)
        except OSError as exc:
            meta_tmp.unlink(missing_ok=True)
            raise output_error(exc, self.directory / INDEX_META_FILE) from exc
        return True

    def remove_unlisted(self, listed: set[str]) -> None:
        # Under the lock no reader is between reading index.json and its files.
        for path in self.directory.iterdir():
            if is_index_file(path.name) and path.name not in listed:
                path.unlink(missing_ok=True)

    def remove_history(self, listed: set[str]) -> None:
        """Local directories keep no earlier generations: as remove_unlisted."""
        self.remove_unlisted(listed)


_SCRATCH_PREFIX = "pipeline-index-"


def _remove_scratch_of_dead_processes() -> None:
    """Scratch folders of workers that were killed (their finalizer never ran): named
    with the pid, removed once no process has it. A pid reused since only delays it."""
    for path in Path(tempfile.gettempdir()).glob(f"{_SCRATCH_PREFIX}*-*"):
        pid = path.name[len(_SCRATCH_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or process_alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)


class ObjectIndexFiles:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.where = f"{describe(store)}/{INDEX_DIR}"
        _remove_scratch_of_dead_processes()
        self.directory = Path(tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{os.getpid()}-"))
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.directory, True)
        self._lock = threading.Lock()
        self._listing: dict[str, ObjectInfo] = {}

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        # Only this process's threads take turns: other writers race, and lose
        # their commit rather than wait (see the module's docstring).
        with self._lock:
            yield

    def _list(self) -> dict[str, ObjectInfo]:
        prefix = f"{INDEX_DIR}/"
        listed = (o for o in self.store.list(prefix) if o.key.count("/") == 1)
        self._listing = {o.key[len(prefix) :]: o for o in listed}
        return self._listing

    def _manifests(self) -> list[str]:
        return sorted(name for name in self._listing if _MANIFEST.match(name))

    def meta_text(self) -> str | None:
        for _ in range(3):
            self._list()
            manifests = self._manifests()
            if not manifests:
                return None
            try:
                return self.store.get(f"{INDEX_DIR}/{manifests[-1]}").decode("utf-8")
            except FileNotFoundError:
                continue  # removed as old between the listing and the read
        raise OutputError(f"the index manifests at {self.where} keep vanishing; try again")

    def sizes(self) -> dict[str, int]:
        """Sizes of the shards in the listing `meta_text` made."""
        return {name: o.size for name, o in self._listing.items() if is_index_file(name)}

    def fetch(self, name: str) -> Path:
        local = self.directory / name
        if not local.exists():
            data = self.store.get(f"{INDEX_DIR}/{name}")
            partial = local.with_name(f".{name}.part")
            partial.write_bytes(data)
            os.replace(partial, local)
        return local

    def release(self, name: str) -> None:
        """Drops the local copy of a shard once read: local disk holds what is in
        flight, not the index."""
        (self.directory / name).unlink(missing_ok=True)

    def commit(self, text: str, generation: int, shards: list[str]) -> bool:
        """Uploads the shards not in the store yet, then creates the manifest of
        `generation`: False when another writer created it first."""
        for name in shards:
            if name not in self._listing:
                self.store.put(f"{INDEX_DIR}/{name}", self.directory / name)
                self.release(name)
        created = self.store.put_if_absent(
            f"{INDEX_DIR}/{manifest_name(generation)}", text.encode("utf-8")
        )
        if not created:
            log.info("index: another writer committed generation %d first; again", generation)
        return created

    def remove_unlisted(self, listed: set[str]) -> None:
        """Deletes old manifests and shards no kept manifest names, past the grace period;
        and local copies no longer listed."""
        for path in self.directory.iterdir():
            if path.name not in listed:
                path.unlink(missing_ok=True)
        self._list()
        kept = self._manifests()[-(KEEP_MANIFESTS + 1) :]
        old = time.time() - GRACE_S
        stale = {name for name, info in self._listing.items() if info.modified < old}
        old_manifests = {n for n in stale if _MANIFEST.match(n) and n not in kept}
        shards = {n for n in stale if is_index_file(n) and n not in listed}
        if shards:  # only then are the kept manifests worth reading (a sync's usual case)
            for manifest in kept:
                shards -= self._shards_named_by(manifest)
        for name in sorted(old_manifests | shards):
            self.store.delete(f"{INDEX_DIR}/{name}")

    def remove_history(self, listed: set[str]) -> None:
        """Erasure (`pipeline compact --purge`): every manifest but the newest and every
        shard they name that `listed` does not, now, whatever their age: they hold the
        vectors of erased versions. A reader of an older generation then fails and
        reads again. Shards no manifest names (a writer's, about to commit) stay."""
        self._list()
        older = self._manifests()[:-1]
        named: set[str] = set()
        for manifest in older:
            named |= self._shards_named_by(manifest)
        for name in sorted((named - listed) | set(older)):
            self.store.delete(f"{INDEX_DIR}/{name}")

    def _shards_named_by(self, manifest: str) -> set[str]:
        try:
            meta = IndexMeta.from_json(self.store.get(f"{INDEX_DIR}/{manifest}").decode("utf-8"))
        except FileNotFoundError:
            return set()
        return {s.file for s in meta.shards}


def manifest_name(generation: int) -> str:
    return f"manifest-{generation:020d}.json"
