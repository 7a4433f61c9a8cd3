"""A `pipeline run` process, measured from outside: its `done:` line, when it polled
its first record, its CPU (with its children: the tokenizer processes) and its peak
RSS; and busy processes beside it, for runs on a loaded host."""

from __future__ import annotations

import multiprocessing
import os
import re
import resource
import shlex
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import HarnessError
from pipeline.core.config import KafkaSettings

DONE = re.compile(
    r"done: (?P<records>\d+) records \((?P<rows>\d+) embedded(?: as (?P<chunks>\d+) chunks)?, "
    r"(?P<dead>\d+) dead-lettered\) "
    r"in (?P<batches>\d+) batches, (?P<seconds>[\d.]+)s, (?P<rate>[\d,.]+) records/s"
)
FIRST = re.compile(r"first record polled (?P<s>[\d.]+)s after process start")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def split_variant(extra: str) -> tuple[dict[str, str], list[str]]:
    """A variant's leading NAME=value words (upper-case names) are environment
    variables for the worker, the rest its extra flags: `MALLOC_ARENA_MAX=8 --replicas 1`."""
    words = shlex.split(extra)
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def command(
    kafka: KafkaSettings,
    topics: str | list[str],
    group: str,
    output: Path | str,
    *flags: str,
    until_end: bool = True,
) -> list[str]:
    """`pipeline run` with its progress bar off; `flags` after the defaults."""
    topic_flags = [
        w for t in ([topics] if isinstance(topics, str) else topics) for w in ("--topic", t)
    ]
    return [
        sys.executable, "-m", "pipeline.cli", "--bootstrap-servers", kafka.bootstrap_servers,
        "run", *topic_flags, "--group", group, "--output", str(output), "--no-progress",
        *(["--until-end"] if until_end else []), *flags,
    ]  # fmt: skip


@dataclass
class Done:
    """A worker's `done:` line."""

    line: str
    records: int
    batches: int
    seconds: float
    rate: float

    @classmethod
    def parse(cls, stderr: str) -> Done:
        lines = [ln for ln in stderr.splitlines() if "done: " in ln]
        match = DONE.search(lines[-1]) if lines else None
        if match is None:
            tail = "\n".join(stderr.splitlines()[-20:])
            raise HarnessError(
                f"the worker printed no parsable `done:` line; it ends with:\n{tail}"
            )
        records, seconds = int(match["records"]), float(match["seconds"])
        rate = float(match["rate"].replace(",", ""))
        # The rate is printed to whole records/s and the time to 0.1 s: the finer one wins.
        if seconds > 0 and (rate <= 0 or 0.05 / seconds < 0.5 / rate):
            rate = records / seconds
        return cls(lines[-1].strip(), records, int(match["batches"]), seconds, rate)


@dataclass
class Outcome:
    """What a finished worker process did, measured from outside."""

    returncode: int
    stderr: str
    seconds: float  # process start to exit
    peak_rss_mb: float | None = None
    # The peak of the worker's RSS and its live children's together (sampled): the
    # tokenizer and engine processes hold memory of their own.
    peak_tree_rss_mb: float | None = None
    startup_s: float | None = None  # process start to first record polled
    # CPU seconds from the first record polled to the `done:` line: the worker
    # process's own, and its children's (the tokenizer processes).
    worker_cpu_s: float | None = None
    children_cpu_s: float | None = None
    done: Done | None = field(default=None)

    def cpu_us_per_record(self) -> float | None:
        if self.done is None or self.worker_cpu_s is None or not self.done.records:
            return None
        return (self.worker_cpu_s + (self.children_cpu_s or 0.0)) / self.done.records * 1e6


def run(
    argv: list[str],
    env: dict[str, str] | None = None,
    timeout_s: float = 1200,
    log: Path | None = None,
) -> Outcome:
    """Runs a worker to its exit, reading its log as it is written: CPU is read at
    the first record and at `done:`, peak RSS from the process's resource usage."""
    began = time.monotonic()
    worker = subprocess.Popen(
        argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env={**os.environ, **OFFLINE, **(env or {})},
    )  # fmt: skip
    watchdog = threading.Timer(timeout_s, worker.kill)
    watchdog.start()
    sampler = _TreeRss(worker.pid)
    lines: list[str] = []
    at_first = at_done = None
    assert worker.stderr is not None
    try:
        for line in worker.stderr:
            lines.append(line)
            if at_first is None and FIRST.search(line):
                at_first = tree_cpu_s(worker.pid)
            elif at_done is None and "done: " in line:
                at_done = tree_cpu_s(worker.pid)
        _, status, usage = os.wait4(worker.pid, 0)
        worker.returncode = os.waitstatus_to_exitcode(status)
    finally:
        watchdog.cancel()
        sampler.stop()
    stderr = "".join(lines)
    if log is not None:
        log.write_text(stderr)
    outcome = Outcome(worker.returncode, stderr, time.monotonic() - began)
    outcome.peak_rss_mb = usage.ru_maxrss / 1024
    outcome.peak_tree_rss_mb = max(sampler.peak_mb, outcome.peak_rss_mb)
    first = FIRST.search(stderr)
    outcome.startup_s = float(first["s"]) if first else None
    if at_first is not None and at_done is not None:
        outcome.worker_cpu_s = at_done[0] - at_first[0]
        outcome.children_cpu_s = at_done[1] - at_first[1]
    if worker.returncode == 0:
        outcome.done = Done.parse(stderr)
    return outcome


def run_until_end(
    kafka: KafkaSettings,
    topics: str | list[str],
    output: Path,
    variant: str = "",
    *flags: str,
    group: str | None = None,
    timeout_s: float = 1200,
) -> Outcome:
    """A bulk run (`--until-end`) of a fresh group, with a variant's environment and flags."""
    env, variant_flags = split_variant(variant)
    group = group or f"bench-{uuid.uuid4().hex[:8]}"
    argv = command(kafka, topics, group, output / group, *flags, *variant_flags)
    outcome = run(argv, env, timeout_s, log=output / f"{group}.log")
    if outcome.returncode != 0:
        raise HarnessError(
            f"the worker failed (exit {outcome.returncode}):\n{outcome.stderr[-3000:]}"
        )
    return outcome


def tree_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of a process itself, and of its descendants: the
    live ones read one by one, the exited ones from their parent's share of
    waited-for children (the tokenizer process ends before the worker's `done:`)."""
    own, descendants = 0.0, 0.0
    for current in tree_pids(pid):
        try:
            fields = (Path("/proc") / str(current) / "stat").read_text().rsplit(")", 1)[1].split()
            user, system, waited_user, waited_system = (int(f) for f in fields[11:15])
        except (OSError, ValueError):
            continue  # exited meanwhile
        if current == pid:
            own += (user + system) / _TICKS
        else:
            descendants += (user + system) / _TICKS
        descendants += (waited_user + waited_system) / _TICKS
    return own, descendants


def tree_pids(pid: int) -> list[int]:
    """A process and its live descendants."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            for task in (Path("/proc") / str(current) / "task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue  # exited meanwhile
    return found


class _TreeRss:
    """Samples the RSS of a process and its descendants together, every 0.1 s."""

    def __init__(self, pid: int) -> None:
        self.peak_mb = 0.0
        self._pid = pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        page_mb = os.sysconf("SC_PAGE_SIZE") / 2**20 if hasattr(os, "sysconf") else 0.0
        while not self._stop.wait(0.1):
            total = 0.0
            for pid in tree_pids(self._pid):
                try:
                    total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page_mb
                except (OSError, ValueError, IndexError):
                    continue
            self.peak_mb = max(self.peak_mb, total)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def own_peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _spin(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        pass


class Busy:
    """`count` processes each keeping one core busy, for the length of a with-block."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.procs: list[multiprocessing.Process] = []

    def __enter__(self) -> Busy:
        for _ in range(self.count):
            proc = multiprocessing.Process(target=_spin, args=(time.monotonic() + 3600,))
            proc.start()
            self.procs.append(proc)
        return self

    def __exit__(self, *exc: Any) -> None:
        for proc in self.procs:
            proc.kill()
            proc.join()


def start(
    kafka: KafkaSettings,
    topics: str | list[str],
    output: Path,
    variant: str = "",
    *flags: str,
    group: str | None = None,
) -> subprocess.Popen[bytes]:
    """A following worker (no --until-end), its log beside `output` (`<output>.log`)."""
    env, variant_flags = split_variant(variant)
    group = group or f"bench-{uuid.uuid4().hex[:8]}"
    argv = command(kafka, topics, group, output, *flags, *variant_flags, until_end=False)
    log = open(output.parent / f"{output.name}.log", "w")  # noqa: SIM115 - the process's
    return subprocess.Popen(argv, stdout=log, stderr=log, env={**os.environ, **OFFLINE, **env})


def wait_for_log(proc: subprocess.Popen[bytes], log: Path, text: str, timeout_s: float) -> None:
    """Until `text` is in the worker's log; a HarnessError if it exits or takes too long."""
    deadline = time.monotonic() + timeout_s
    while text not in (log.read_text() if log.exists() else ""):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise HarnessError(f"the worker did not get to {text!r}; see {log}")
        time.sleep(0.1)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    """A worker's Prometheus metrics, by sample name with labels ({} where unreachable)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except OSError:
        return {}
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
