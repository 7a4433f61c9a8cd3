"""The CPUs this process may use, how the model's threads are laid out on them, and
running a call on a short-lived thread of its own, for where torch work runs.

`os.cpu_count()` is the host's core count; a container limited by a CPU quota, or
a process pinned with taskset, may use far fewer. Sizing torch's thread team by
the host made every pass a team of threads fighting for one or two real cores.

libgomp (torch's OpenMP on the CPU) gives each thread that runs parallel ops a
team of pool threads for the rest of that thread's life. Once it manages more
threads than there are cores, it stops spin-waiting between parallel regions and
every region pays futex wake-ups: forward passes on the worker's embed thread ran
10% slower on 2 cores after the model had been loaded on the main thread. A call
made here runs on a thread that exits afterwards, taking its team with it, so
the thread that embeds later has the only one.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Each replica holds a pass's activations: memory, not only cores, bounds replicas.
MAX_DEFAULT_REPLICAS = 4
# Tokenizing on more threads than this gained nothing on a 16-core GPU host.
MAX_CUDA_TOKENIZER_THREADS = 8


def usable_cpus(cgroup_root: Path = CGROUP_ROOT, proc_self: Path = Path("/proc/self")) -> int:
    """CPUs this process may run on: affinity, bounded by a cgroup CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_self)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota - 0.01)))
    return max(1, cpus)


def cgroup_cpu_quota(cgroup_root: Path, proc_self: Path) -> float | None:
    """The CPU quota in cores (cgroup v2 cpu.max, or v1 cfs quota/period); None if unlimited."""
    for directory in _cgroup_dirs(cgroup_root, proc_self):
        v2 = _read(directory / "cpu.max")
        if v2 is not None:
            quota, _, period = v2.partition(" ")
            if quota != "max" and period:
                return int(quota) / int(period)
            return None
        quota_us = _read(directory / "cpu.cfs_quota_us")
        period_us = _read(directory / "cpu.cfs_period_us")
        if quota_us is not None and period_us is not None:
            return int(quota_us) / int(period_us) if int(quota_us) > 0 else None
    return None


def _cgroup_dirs(root: Path, proc_self: Path) -> list[Path]:
    """The process's own cgroup first (as /proc/self/cgroup names it), then the root."""
    dirs: list[Path] = []
    for line in (_read(proc_self / "cgroup") or "").splitlines():
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":
            dirs.append(root / relative)
        elif "cpu" in controllers.split(","):
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                dirs.append(root / mount / relative)
                dirs.append(root / mount)
    dirs.append(root)
    return dirs


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, ValueError):
        return None


def release_free_memory() -> None:
    """Hands the allocator's free pages back to the OS (glibc malloc_trim; elsewhere a no-op).

    glibc keeps freed activation buffers in its heap, and raises its mmap threshold
    as large blocks are freed, so that a worker's RSS ratchets up with every new
    mix of pass sizes. A trim after each micro-batch keeps the resting RSS where it
    started, for a few milliseconds a batch and no slower passes (a fixed mmap
    threshold slowed them: docs/performance.md).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


# glibc's mallopt() parameter for the number of arenas (malloc.h: M_ARENA_MAX).
_M_ARENA_MAX = -8


def use_one_malloc_arena() -> bool:
    """Makes every thread allocate from glibc's main heap (M_ARENA_MAX=1), so that
    `release_free_memory` can give all of its free pages back; False where it cannot.

    Call it before other threads start. By default each thread that allocates while
    another holds the lock gets an arena of its own (up to 8 per core: the worker
    had 15). malloc_trim() gives back free chunks in every arena but shrinks only
    the main heap's top: the top of another arena's heap, where a large pass's
    activations fall back once freed, stays resident, and free() shrinks it only
    past the trim threshold, which glibc raises with the mmap threshold (to 64 MB
    once the model's tensors have come and gone). With one arena catch-up batches
    in a nearline stream leave a few MB in the heap instead of tens, at the same
    speed (scripts/catchup_memory.py; docs/performance.md); a worker has more
    threads, so more heaps.
    A MALLOC_ARENA_MAX in the environment is left to rule.
    """
    if "MALLOC_ARENA_MAX" in os.environ:
        return False  # the user's own choice, which glibc has applied already
    libc = _libc()
    try:
        return libc is not None and bool(libc.mallopt(_M_ARENA_MAX, 1))
    except AttributeError:
        return False  # not glibc


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    return getattr(_libc(), "malloc_trim", None)


# prctl()'s option for the signal a process gets when its parent dies (linux/prctl.h).
_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Asks Linux to send `signum` to this process when its parent dies; elsewhere a
    no-op (an orphan then runs to its end). Check os.getppid() after: the parent
    may have died before. Linux sends it when the *thread* that started this process
    ends: only for a child started on a thread that lives as long as the worker (the
    tokenizer process: the poll thread; not the model-loading thread)."""
    prctl = getattr(_libc(), "prctl", None) if sys.platform.startswith("linux") else None
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def serve_as_child(fd: int, serve: Callable[[Connection], None], bug: str) -> None:
    """A worker's child process: `serve` on the connection at `fd`. Signals to the
    whole group (Ctrl-C, a service manager stopping the unit) are the worker's to act
    on, which then closes the child; the connection closing ends it quietly; any
    other exception is a bug, sent back as (`bug`, traceback), and exit status 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        serve(conn)
    except (EOFError, ConnectionError):
        return  # the worker closed its end, or is gone
    except Exception:  # its traceback goes to the worker, which stops with it
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps((bug, traceback.format_exc())))
        sys.exit(1)


def how_child_ended(child: subprocess.Popen[Any]) -> str:
    """How a child process whose connection closed or went silent ended: "exited
    with code N", or "stopped answering" while it still runs."""
    try:  # its end of a socket closes a moment before it can be reaped
        code = child.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        return "stopped answering"
    return f"exited with code {code}"


def process_age_s() -> float:
    """Seconds since this process started (from /proc; 0.0 where there is none)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))


@dataclass(frozen=True)
class CpuPlan:
    """How the model's work is laid out: replicas, each with a team of threads, and
    the threads that tokenize each batch."""

    replicas: int
    threads_per_replica: int
    tokenizer_threads: int = 1
    device: str = "cpu"

    def __str__(self) -> str:
        return (
            f"{self.replicas} replica(s) x {self.threads_per_replica} thread(s) on {self.device}, "
            f"{self.tokenizer_threads} tokenizer thread(s)"
        )


def plan_cpu(
    device: str,
    cpus: int,
    replicas: int | None = None,
    threads_per_replica: int | None = None,
) -> CpuPlan:
    """Replicas and threads for the model, from the usable CPUs unless given.

    On the CPU: one single-threaded replica per usable core (leaving one core
    for polling, tokenizing and writing above two), at most MAX_DEFAULT_REPLICAS,
    the remaining cores shared out as threads; tokenizing shares the same cores.
    On CUDA one replica (the GPU serialises passes anyway) and the CPUs tokenize:
    there the tokenizer is the ceiling (an H200 embedded short texts at 67,600/s
    while one tokenizer thread managed 10,000/s, eight 52,600/s, fifteen no more).
    """
    if device == "cuda":
        tokenizers = min(MAX_CUDA_TOKENIZER_THREADS, max(1, cpus - 1))
        return CpuPlan(replicas or 1, threads_per_replica or 1, tokenizers, device)
    budget = cpus if cpus <= 2 else cpus - 1
    if replicas is None:
        per = threads_per_replica or 1
        replicas = max(1, min(MAX_DEFAULT_REPLICAS, budget // per))
    if threads_per_replica is None:
        threads_per_replica = max(1, budget // replicas)
    return CpuPlan(replicas, threads_per_replica, replicas * threads_per_replica, device)


def start_on_fresh_thread(fn: Callable[[], T], name: str = "fresh") -> Future[T]:
    """fn() on a new thread that exits when fn returns (only replicas' threads keep
    OpenMP teams); its result or exception comes through the future."""
    future: Future[T] = Future()
    future.set_running_or_notify_cancel()

    def target() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)

    threading.Thread(target=target, name=name, daemon=True).start()
    return future


def call_on_fresh_thread(fn: Callable[[], T], name: str = "fresh") -> T:
    """fn() on a new thread, joined; its exception, if any, is raised here."""
    return start_on_fresh_thread(fn, name).result()


def fsync_dir(directory: Path) -> None:
    """Makes a rename or a new file in `directory` durable (the entry, not the data)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Allocations between collections of the youngest generation (CPython's default: 700).
# Lower, the steady state's young collections took a measurable share of the worker's
# GIL with a tiny model (docs/performance.md); at this one the young objects mostly
# die before a collection walks them, and cyclic garbage waits a little longer.
GC_YOUNG_THRESHOLD = 100_000


def freeze_start_up_objects() -> None:
    """Takes what start-up loaded (modules, the model, the configuration: hundreds of
    thousands of objects with torch and numpy, alive until exit) out of the cyclic
    collector's reach, and lets it run less often.

    The poll thread makes several short-lived objects per record, freed by
    reference counting; with the defaults they still set off a young collection
    every 700 allocations and an older one every few, and the older ones walked
    every start-up object again each time.
    """
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
