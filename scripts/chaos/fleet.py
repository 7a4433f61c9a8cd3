"""The workers of a seed: real `pipeline run` processes, started, stopped, killed and
stalled on schedule, and the trickle of records published meanwhile."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness import worker_log

from chaos.common import PYTHON, READY, REPO, SESSION_TIMEOUT_MS
from chaos.plans import EventLog


class Trickle(threading.Thread):
    """Publishes small kafka-python chunks while workers run; pausable around restarts."""

    def __init__(
        self, publish: Callable[[random.Random, int], None], seed: int, chunk: tuple[int, int]
    ) -> None:
        super().__init__(name="trickle", daemon=True)
        self._publish = publish
        self._chunk = chunk
        self._rng = random.Random(seed * 7919 + 1)
        self._halt = threading.Event()
        self._resumed = threading.Event()
        self._resumed.set()
        self._busy = threading.Lock()
        self.error: BaseException | None = None

    def run(self) -> None:
        while not self._halt.is_set():
            self._resumed.wait()
            if self._halt.is_set():
                return
            with self._busy:
                try:
                    self._publish(self._rng, self._rng.randint(*self._chunk))
                except BaseException as exc:  # reported by the seed, never silently
                    self.error = exc
                    return
            self._halt.wait(self._rng.uniform(0.2, 1.2))

    def pause(self) -> None:
        self._resumed.clear()
        with self._busy:  # the chunk being sent is flushed first
            pass

    def resume(self) -> None:
        self._resumed.set()

    def finish(self) -> None:
        self._halt.set()
        self._resumed.set()
        self.join(timeout=180)


# ---------------------------------------------------------------------------- workers


@dataclass
class WorkerProc:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    until_end: bool
    started_at: float
    batch_size: int
    killed: bool = False  # SIGKILLed by the harness: any exit status is fine
    terminated: bool = False  # SIGTERMed by the harness: must exit 0
    stopped: bool = False  # SIGSTOPped right now
    returncode: int | None = None

    @property
    def alive(self) -> bool:
        return self.returncode is None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def owned(self) -> set[tuple[str, int]]:
        """Partitions it owns, replayed from its own log lines (for picking victims)."""
        return worker_log.owned(self.log_text())


@dataclass(frozen=True)
class WorkerSettings:
    topic: str
    group: str
    output: Path
    model: Path
    bootstrap: str
    log_level: str
    batch_sizes: tuple[int, ...]
    poll_timeout_ms: int
    max_in_flight: int
    index_sync_interval_s: float
    # consumers.stages' pauses (pipeline.core.failpoints), e.g. between a batch's dead
    # letters and its publish, for signals to land in.
    failpoints: str = ""
    write_mode: str = "append"  # upsert: records are versions of documents (--write-mode)
    view_sync_interval_s: float | None = None  # upsert mode's --view-sync-interval-s
    chunk_tokens: int | None = None  # chunk mode: --chunk-tokens N (None: not chunked)
    chunk_overlap: int | None = None  # with it: --chunk-overlap M (None: the worker's 0)


class Fleet:
    """The worker processes of one seed."""

    def __init__(self, settings: WorkerSettings, log_dir: Path, events: EventLog) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.events = events
        self.workers: list[WorkerProc] = []

    def _args(self, batch_size: int, until_end: bool) -> list[str]:
        s = self.settings
        args = [PYTHON, "-m", "pipeline.cli", "--log-level", s.log_level, "run"]
        args += ["--topic", s.topic, "--group", s.group, "--output", str(s.output)]
        args += ["--model", str(s.model), "--precision", "fp32", "--device", "cpu"]
        args += ["--no-progress", "--torch-threads", "1", "--batch-size", str(batch_size)]
        args += ["--session-timeout-ms", str(SESSION_TIMEOUT_MS)]
        args += ["--poll-timeout-ms", str(s.poll_timeout_ms)]
        args += ["--max-in-flight", str(s.max_in_flight)]
        args += ["--index-sync-interval-s", str(s.index_sync_interval_s)]
        if s.write_mode != "append":
            args += ["--write-mode", s.write_mode]
        if s.view_sync_interval_s is not None:
            args += ["--view-sync-interval-s", str(s.view_sync_interval_s)]
        if s.chunk_tokens is not None:
            args += ["--chunk-tokens", str(s.chunk_tokens)]
        if s.chunk_overlap is not None:
            args += ["--chunk-overlap", str(s.chunk_overlap)]
        return [*args, "--until-end"] if until_end else args

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PIPELINE_BOOTSTRAP_SERVERS=self.settings.bootstrap,
            HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
            PIPELINE_FAILPOINTS=self.settings.failpoints,
        )
        return env

    def start(self, count: int, rng: random.Random, until_end: bool = False) -> list[WorkerProc]:
        """Starts `count` workers back to back (the same moment, as `--scale N` does)."""
        batch_sizes = [rng.choice(self.settings.batch_sizes) for _ in range(count)]
        started = []
        for batch_size in batch_sizes:
            name = f"w{len(self.workers) + 1}{'-bulk' if until_end else ''}"
            log = self.log_dir / f"{name}.log"
            with open(log, "ab") as out:
                proc = subprocess.Popen(
                    self._args(batch_size, until_end),
                    env=self._env(),
                    cwd=REPO,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            worker = WorkerProc(name, proc, log, until_end, time.monotonic(), batch_size)
            self.workers.append(worker)
            started.append(worker)
        names = ", ".join(f"{w.name}(pid {w.proc.pid}, batch {w.batch_size})" for w in started)
        self.events.write(f"start {names}{' --until-end' if until_end else ''}")
        return started

    def live(self) -> list[WorkerProc]:
        return [w for w in self.workers if w.alive and not w.until_end]

    def reap(self) -> None:
        for worker in self.workers:
            if worker.returncode is None and worker.proc.poll() is not None:
                worker.returncode = worker.proc.returncode
                self.events.write(f"{worker.name} exited {worker.returncode}")

    def wait_ready(self, workers: Sequence[WorkerProc], timeout_s: float = 150) -> None:
        """Until each worker has loaded its model (or exited) and one of them owns partitions."""
        deadline = time.monotonic() + timeout_s
        pending = list(workers)
        while time.monotonic() < deadline:
            self.reap()
            pending = [w for w in pending if w.alive and not READY.search(w.log_text())]
            if not pending and any(w.owned() for w in workers if w.alive):
                self.events.write(f"ready: {[w.name for w in workers]}")
                return
            if not any(w.alive for w in workers):
                break
            time.sleep(0.3)
        self.events.write(f"not ready after {timeout_s:.0f}s: {[w.name for w in pending]}")

    def pick(self, rng: random.Random, owning: bool = True) -> WorkerProc | None:
        """A live, running worker, preferably one that owns partitions right now."""
        candidates = [w for w in self.live() if not w.stopped]
        if owning:
            candidates = [w for w in candidates if w.owned()] or candidates
        return rng.choice(candidates) if candidates else None

    def send(self, worker: WorkerProc, sig: signal.Signals) -> None:
        if not worker.alive or (sig == signal.SIGTERM and worker.terminated):
            return  # a second SIGTERM means "stop now" (exit 130): never sent twice
        owned = sorted(p for _, p in worker.owned())
        worker.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            worker.killed = True
        elif sig == signal.SIGTERM:
            worker.terminated = True
        elif sig == signal.SIGSTOP:
            worker.stopped = True
        elif sig == signal.SIGCONT:
            worker.stopped = False
        self.events.write(f"{sig.name} {worker.name} (owned partitions {owned})")

    def wait(self, workers: Iterable[WorkerProc], timeout_s: float) -> list[WorkerProc]:
        """Waits for workers to exit; returns those still running at the deadline."""
        deadline = time.monotonic() + timeout_s
        waiting = [w for w in workers if w.returncode is None]
        while waiting and time.monotonic() < deadline:
            self.reap()
            waiting = [w for w in waiting if w.returncode is None]
            time.sleep(0.2)
        return waiting

    def terminate_all(self, timeout_s: float = 90) -> list[WorkerProc]:
        """SIGCONT + SIGTERM every live worker; returns those that did not exit in time."""
        for worker in self.workers:
            if worker.stopped:
                self.send(worker, signal.SIGCONT)
        for worker in self.workers:
            if worker.alive:
                self.send(worker, signal.SIGTERM)
        stuck = self.wait(self.workers, timeout_s)
        for worker in stuck:
            self.events.write(f"{worker.name} did not exit within {timeout_s:.0f}s: SIGKILL")
            worker.proc.kill()
            worker.proc.wait(timeout=30)
            worker.returncode = worker.proc.returncode
        return stuck

    def kill_all(self) -> None:
        """Emergency clean-up: nothing the harness started outlives it."""
        for worker in self.workers:
            if worker.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(signal.SIGCONT)
                    worker.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    worker.proc.wait(timeout=30)
