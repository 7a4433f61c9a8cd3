"""Changing several segment files at once, atomically for anyone listing them.

Compaction replaces many small segments by one. A reader that lists
`DIR/vectors/` (pyarrow.dataset, DuckDB, Polars, our own status and audit) must
see either all the sources or the merged file, never both and never neither, and
POSIX has no rename of several files at once. So the compactor builds the next
`vectors/` beside it (hard links of every file it keeps, plus the merged files)
and exchanges the two directories in one `renameat2(RENAME_EXCHANGE)`.

Writers must not add files to the old directory while the next one is built, or
those files would be left behind: they hold `DIR/.vectors.lock` shared while they
create, write or publish a file in `vectors/` (or move one out), and the
compactor holds it exclusively only to build and exchange (milliseconds for
thousands of files). Neither waits without a deadline.

A reader that listed the directory before an exchange and opens a merged-away
file after it gets FileNotFoundError (never a wrong answer: the merged file has
a name the old listing did not have); our readers detect the exchange and read
again (see `read_consistently`). The old directory is kept aside a while after
the exchange (`sinks.compaction.RETIRED_GRACE_S`), not removed at once: a reader
still listing it would otherwise miss the entries removed under it, and then
open the rest, by name, in the new directory: rows missing, without an error.
Each `vectors/` a compaction builds holds a token of its own (`.generation`),
so that an exchange is seen even where a directory's inode number was reused.

Compacted segments are named by their range, `<first>-<last>.parquet`, so a
writer that stalled past a rebalance cannot publish a name inside a merged
range: create-if-absent alone would let it, as the sources' names are free
again. `vectors/.compacted/` records each partition's merged ranges, and a
publish inside one whose merged file still exists is a lost race.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import platform
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TypeVar

from pipeline.core.errors import OutputError
from pipeline.core.layout import (
    GENERATION_FILE,
    VECTORS_DIR,
    Output,
    SegmentKey,
    directory_identity,
    vectors_dir,
)

T = TypeVar("T")

LOCK_FILE = ".vectors.lock"
FENCE_DIR = ".compacted"
# How long a writer waits for a compaction's exchange, and a compaction for
# writers between two files: both take milliseconds when things are well.
WRITER_WAIT_S = 120.0
COMPACTOR_WAIT_S = 60.0
_POLL_S = 0.005


class VectorsLock:
    """`DIR/.vectors.lock`: shared by writers, exclusive for an exchange."""

    def __init__(self, output: Path) -> None:
        self.path = output / LOCK_FILE
        self._handle: IO[bytes] | None = None
        self._depth = 0

    @contextmanager
    def shared(self, wait_s: float = WRITER_WAIT_S) -> Iterator[None]:
        with self._held(fcntl.LOCK_SH, wait_s, "a compaction is exchanging it"):
            yield

    @contextmanager
    def exclusive(self, wait_s: float = COMPACTOR_WAIT_S) -> Iterator[None]:
        with self._held(fcntl.LOCK_EX, wait_s, "workers keep writing into it"):
            yield

    @contextmanager
    def _held(self, mode: int, wait_s: float, why: str) -> Iterator[None]:
        if self._depth:  # re-entered (a publish inside a held block): already ours
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        handle = self._open()
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle.fileno(), mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise OutputError(
                        f"{self.path.parent / VECTORS_DIR} stayed locked for {wait_s:.0f}s "
                        f"({why}); try again"
                    ) from None
                time.sleep(_POLL_S)
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def _open(self) -> IO[bytes]:
        if self._handle is None:
            try:
                self._handle = open(self.path, "a+b")  # noqa: SIM115 - kept for the process
            except OSError as exc:
                raise OutputError(f"cannot open {self.path}: {exc}") from exc
        return self._handle


# -- the exchange --------------------------------------------------------------------

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276}


def exchange(a: Path, b: Path) -> None:
    """Swaps two directories in one step (Linux renameat2 RENAME_EXCHANGE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    args = (_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if hasattr(libc, "renameat2"):
        result = libc.renameat2(*args)
    elif platform.machine() in _SYS_RENAMEAT2:
        result = libc.syscall(_SYS_RENAMEAT2[platform.machine()], *args)
    else:
        raise OutputError("compaction needs Linux's renameat2, not found on this system")
    if result != 0:
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OutputError(
                f"the filesystem of {a} cannot exchange two directories atomically "
                "(renameat2 RENAME_EXCHANGE), which compaction needs: ext4, xfs, btrfs and "
                "tmpfs can; NFS cannot"
            )
        raise OutputError(f"exchanging {a} and {b} failed: {os.strerror(code)}")


def link_tree(source: Path, target: Path, leave_out: set[Path]) -> int:
    """Hard-links every file under `source` into `target` (same layout) except
    `leave_out`; returns how many. Locks held on the files stay held: same inodes."""
    linked = 0
    target.mkdir()
    for entry in os.scandir(source):
        path = Path(entry.path)
        if path in leave_out:
            continue
        if entry.is_dir(follow_symlinks=False):
            linked += link_tree(path, target / entry.name, leave_out)
            continue
        try:
            os.link(path, target / entry.name, follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed meanwhile (a lock file of a writer that just exited)
        linked += 1
    return linked


def read_consistently(output: Output, read: Callable[[], T], attempts: int = 5) -> T:
    """Runs `read` (which lists and reads segments) until no exchange happened
    during it; FileNotFoundError inside counts as one. (Object stores: no
    compaction exchanges files there, so `read` runs once.)"""
    if not isinstance(output, Path):
        return read()
    for attempt in range(attempts):
        before = _identity(output)
        try:
            result = read()
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise
            continue
        if _identity(output) == before:
            return result
    return read()


def write_generation(directory: Path) -> None:
    """A token no other `vectors/` holds, in one a compaction is about to swap in."""
    (directory / GENERATION_FILE).write_text(uuid.uuid4().hex)


def _identity(output: Path) -> tuple[int, int, str | None] | None:
    return directory_identity(vectors_dir(output))


# -- fences of merged ranges ---------------------------------------------------------


def fence_path(directory: Path, topic: str, partition: int) -> Path:
    return directory / FENCE_DIR / f"{topic}-p{partition:05d}.json"


def write_fences(
    directory: Path, topic: str, partition: int, ranges: list[tuple[int, int]]
) -> None:
    path = fence_path(directory, topic, partition)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(sorted(ranges)))
    os.replace(tmp, path)


def fenced(directory: Path, key: SegmentKey) -> bool:
    """True when `key.first` lies inside a merged range whose file still exists."""
    path = fence_path(directory, key.topic, key.partition)
    try:
        ranges = json.loads(path.read_text())
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as exc:
        raise OutputError(f"cannot read {path}: {exc}") from exc
    for first, last in ranges:
        if first <= key.first <= last:
            merged = f"{key.topic}-p{key.partition:05d}-{first:020d}-{last:020d}.parquet"
            if (directory / merged).exists():
                return True
    return False
