"""The host: usable CPUs (affinity, cgroup quotas), the replica/thread plan, and
call_on_fresh_thread: the result or the exception of a call made on another thread."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pipeline.core.errors import ModelError
from pipeline.core.host import (
    CpuPlan,
    call_on_fresh_thread,
    cgroup_cpu_quota,
    plan_cpu,
    usable_cpus,
)


def test_returns_the_result_of_a_call_made_on_another_thread() -> None:
    caller = threading.get_ident()
    ran_on = call_on_fresh_thread(threading.get_ident, name="probe")
    assert ran_on != caller


def test_raises_the_calls_exception_in_the_caller() -> None:
    def fail() -> None:
        raise ModelError("no such model")

    with pytest.raises(ModelError, match="no such model"):
        call_on_fresh_thread(fail)


def test_the_thread_is_gone_afterwards() -> None:
    before = threading.active_count()
    call_on_fresh_thread(lambda: None)
    assert threading.active_count() == before


# ------------------------------------------------------------------ usable CPUs


def fake_proc(tmp_path: Path, cgroup_line: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup_line + "\n")
    return proc


def test_a_cgroup_v2_quota_bounds_the_usable_cpus(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    (root / "kubepods" / "pod1").mkdir(parents=True)
    (root / "kubepods" / "pod1" / "cpu.max").write_text("150000 100000\n")
    proc = fake_proc(tmp_path, "0::/kubepods/pod1")
    assert cgroup_cpu_quota(root, proc) == 1.5
    assert usable_cpus(root, proc) == min(2, len(os.sched_getaffinity(0)))


def test_no_quota_leaves_the_affinity(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cpu.max").write_text("max 100000\n")
    proc = fake_proc(tmp_path, "0::/")
    assert cgroup_cpu_quota(root, proc) is None
    assert usable_cpus(root, proc) == len(os.sched_getaffinity(0))


def test_a_cgroup_v1_quota_is_read_too(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    (root / "cpu,cpuacct").mkdir(parents=True)
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("100000\n")
    (root / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    proc = fake_proc(tmp_path, "4:cpu,cpuacct:/")
    assert cgroup_cpu_quota(root, proc) == 1.0
    assert usable_cpus(root, proc) == 1


def test_affinity_bounds_the_usable_cpus() -> None:
    assert usable_cpus() <= len(os.sched_getaffinity(0))
    if len(os.sched_getaffinity(0)) > 1:
        script = "from pipeline.core.host import usable_cpus; print(usable_cpus())"
        pinned = subprocess.run(
            ["taskset", "-c", "0", sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        assert pinned.stdout.strip() == "1"


@pytest.mark.parametrize(
    ("device", "cpus", "replicas", "threads", "expected"),
    [
        ("cpu", 1, None, None, CpuPlan(1, 1, 1)),
        ("cpu", 2, None, None, CpuPlan(2, 1, 2)),
        ("cpu", 4, None, None, CpuPlan(3, 1, 3)),
        ("cpu", 16, None, None, CpuPlan(4, 3, 12)),
        ("cpu", 16, None, 2, CpuPlan(4, 2, 8)),
        ("cpu", 8, 1, None, CpuPlan(1, 7, 7)),
        ("cpu", 2, None, 2, CpuPlan(1, 2, 2)),
        ("cuda", 16, None, None, CpuPlan(1, 1, 8, "cuda")),
        ("cuda", 4, None, None, CpuPlan(1, 1, 3, "cuda")),
    ],
)
def test_the_cpu_plan(
    device: str, cpus: int, replicas: int | None, threads: int | None, expected: CpuPlan
) -> None:
    assert plan_cpu(device, cpus, replicas, threads) == expected


def test_releasing_free_memory_gives_pages_back() -> None:
    """After a burst of freed blocks the resting RSS comes down (glibc's heap)."""
    script = (
        "from pipeline.core.host import release_free_memory\n"
        "def rss():\n"
        "    return int(open('/proc/self/statm').read().split()[1])\n"
        "blocks = [bytearray(100_000) for _ in range(2000)]\n"  # heap, under the mmap threshold
        "keep = blocks[-1]\n"  # pins the top of the heap, so that free() alone cannot shrink it
        "del blocks\n"
        "before = rss()\n"
        "release_free_memory()\n"
        "print(before, rss())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    before, after = (int(n) for n in done.stdout.split())
    page_mb = os.sysconf("SC_PAGE_SIZE") / 2**20
    assert (before - after) * page_mb > 100  # of the ~200 MB freed


_THREAD_HEAPS = (
    "import sys, threading\n"
    "from pipeline.core.host import use_one_malloc_arena\n"
    "if sys.argv[1] == 'one':\n"
    "    assert use_one_malloc_arena()\n"
    "def heaps():\n"  # glibc's thread heaps: anonymous read-write mappings on 64 MiB
    "    n = 0\n"
    "    for line in open('/proc/self/maps'):\n"
    "        fields = line.split()\n"
    "        start = int(fields[0].split('-')[0], 16)\n"
    "        n += len(fields) == 5 and fields[1][:2] == 'rw' and start % (64 << 20) == 0\n"
    "    return n\n"
    "before = heaps()\n"
    "def work():\n"
    "    blocks = [bytearray(100_000) for _ in range(64)]\n"
    "    del blocks\n"
    "threads = [threading.Thread(target=work) for _ in range(4)]\n"
    "for t in threads:\n"
    "    t.start()\n"
    "for t in threads:\n"
    "    t.join()\n"
    "print(before, heaps())\n"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's arenas")
def test_with_one_malloc_arena_threads_allocate_from_the_main_heap() -> None:
    """The worker's threads share glibc's main heap, whose free pages malloc_trim
    gives back in full; by default each thread gets a heap of its own."""

    def thread_heaps(mode: str) -> tuple[int, int]:
        done = subprocess.run(
            [sys.executable, "-c", _THREAD_HEAPS, mode],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        before, after = (int(n) for n in done.stdout.split())
        return before, after

    default = thread_heaps("default")
    assert default[1] > default[0]  # the mechanism the setting turns off
    assert thread_heaps("one") == (0, 0)
