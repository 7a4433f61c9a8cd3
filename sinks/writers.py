"""Who writes into an output directory, and which temp files are garbage.

Each process that stages segments holds an exclusive lock on a file of its own,
`DIR/vectors/.writers/<writer>.lock`, for as long as it lives. The kernel drops
the lock when the process dies, however it dies (SIGKILL included), so another
process can tell a dead writer from a live one by trying to take that lock,
whatever host name or pid it had: containers change their host name on every
start, and several containers share one volume (flock works across them, as
they share the kernel, and over NFS through its lock manager).

A temp file is garbage when its writer's lock can be taken (dead), or, for
writers without a lock file (older versions, or a filesystem without locks),
when its writer was a process of this host that is gone, or when it is older
than any live write takes. Removing a live writer's temp file is safe anyway:
its publish then fails like a lost race, and the range is written again.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import IO

from pipeline.core.host import process_alive
from pipeline.core.layout import TMP_SUFFIX

HOST = socket.gethostname().replace(".", "_")
# Distinguishes this process from an earlier one with the same pid (pid 1 in containers).
TOKEN = os.urandom(4).hex()
WRITER = f"{HOST}.{os.getpid()}.{TOKEN}"
WRITERS_DIR = ".writers"
LOCK_SUFFIX = ".lock"
# Past this age a temp file is garbage whoever wrote it: a live writer stages and
# publishes within seconds.
STALE_TEMP_AGE_S = 15 * 60

# The lock files this process holds, by directory: open for the process's lifetime.
_held: dict[Path, IO[bytes]] = {}


def hold_writer_lock(directory: Path) -> None:
    """Takes this process's writer lock in `directory` (once per process and directory)."""
    if directory in _held:
        return
    locks = directory / WRITERS_DIR
    locks.mkdir(exist_ok=True)
    # Locked before it gets its name, so that nobody ever sees it unlocked.
    fresh = locks / f"{WRITER}{LOCK_SUFFIX}.new"
    handle = open(fresh, "wb")  # noqa: SIM115 - held until the process exits
    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(fresh, locks / f"{WRITER}{LOCK_SUFFIX}")
    _held[directory] = handle


def remove_stale_temp_files(directory: Path, max_age_s: float = STALE_TEMP_AGE_S) -> int:
    """Removes the temp files of dead writers (see the module docstring); returns how many."""
    removed = 0
    now = time.time()
    for path in directory.glob(f".*{TMP_SUFFIX}"):
        writer = path.name[: -len(TMP_SUFFIX)].rsplit(".", 3)[1:]
        try:
            old = now - path.stat().st_mtime > max_age_s
        except FileNotFoundError:
            continue  # published or removed meanwhile
        if old or _writer_is_dead(directory, writer):
            path.unlink(missing_ok=True)
            removed += 1
    _remove_dead_locks(directory)
    return removed


def _writer_is_dead(directory: Path, writer: list[str]) -> bool:
    if len(writer) != 3 or not writer[1].isdigit():
        return True  # not a name this sink makes
    if ".".join(writer) == WRITER:
        return False
    locked = _lock_state(directory / WRITERS_DIR / f"{'.'.join(writer)}{LOCK_SUFFIX}")
    if locked is not None:
        return not locked
    host, pid = writer[0], int(writer[1])
    if host != HOST:
        return False  # no lock to ask and another host: only age tells
    return pid == os.getpid() or not process_alive(pid)


def _lock_state(lock: Path) -> bool | None:
    """True while a live process holds the lock, False once it is free, None without one."""
    try:
        handle = open(lock, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return None
    with handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return None  # a filesystem without locks: say nothing
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        return False


def _remove_dead_locks(directory: Path) -> None:
    locks = directory / WRITERS_DIR
    if not locks.is_dir():
        return
    for lock in locks.glob(f"*{LOCK_SUFFIX}"):
        if lock.name != f"{WRITER}{LOCK_SUFFIX}" and _lock_state(lock) is False:
            lock.unlink(missing_ok=True)
