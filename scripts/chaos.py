#!/usr/bin/env python
"""Seeded chaos against a real broker: does every record land exactly once?

Each seed runs one scenario on its own topic, group and output directory:

1. publish a backlog: JSON records from kafka-python with every codec (none,
   gzip, snappy, lz4, zstd), a few bad records (invalid JSON or UTF-8, empty or
   missing text, not an object, tombstones, oversize text) that must go to the
   dead-letter topic, and, when scripts/java/ForeignProducer.java exists,
   records from the official Java producer with codecs and transactions,
   aborted ones included;
2. run a seeded schedule of events on real `pipeline run` processes while more
   records trickle in: several workers starting at the same moment, workers
   joining, SIGTERM, SIGKILL at a random moment, SIGSTOP past the session
   timeout then SIGCONT (and short pauses inside it), broker restarts (and a
   freshly wiped broker), bursts from both producers, published segments
   damaged on disk with a dead host's temp file beside them;
3. finish with `pipeline run --until-end` (one or two workers, alone or beside
   running workers, sometimes through a broker restart);
4. check the outputs independently of the worker: every committed record of
   the topic (read with a read_committed consumer) is in exactly one Parquet
   row, or, if it is a bad record, in the dead-letter topic; no row or dead
   letter names an offset that holds no committed record (aborted records,
   transaction markers); the FAISS index holds every row once; the group's
   commits reach the end. `pipeline audit` runs too when it exists, and its
   verdict is compared with this one.

Scenarios (by default seed N runs the ((N-1) mod 9)th): together, join, sigkill,
stall, broker-restart, foreign, storm (a random mix), slow-batches (a slower
random model and long texts, so that rebalances find batches in flight) and
damage. Workers embed with scripts/tiny_model.py's random models, so that a
run's time goes to Kafka and to the worker's protocol, not to the model.

The harness runs its own broker (scripts/dev-kafka.sh with another port and
home), so it never disturbs the shared one on 9092:

    .venv/bin/python scripts/chaos.py --seeds 1-50 [--scenario NAME[,NAME...]]
        [--keep-going] [--json FILE] [--port 19092] [--work-dir DIR]

One line per seed (scenario, events, records, lost, doubled, phantom, seconds),
then a summary. Exit 0 only when every seed passed: nothing lost, doubled or
phantom, and no worker exited non-zero unless the harness SIGKILLed it.
Worker logs and the harness's own event log stay under the work directory.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from tiny_model import ensure_tiny_model  # noqa: E402

_VENV_PYTHON = REPO / ".venv" / "bin" / "python"
PYTHON = str(_VENV_PYTHON if _VENV_PYTHON.exists() else Path(sys.executable))
DEV_KAFKA = REPO / "scripts" / "dev-kafka.sh"
FOREIGN_PRODUCER = REPO / "scripts" / "java" / "ForeignProducer.java"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))) / "embedding-pipeline"
SHARED_BROKER_PORT = 9092

CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
SESSION_TIMEOUT_MS = 6000
TMP_SUFFIX = ".tmp"  # pipeline.core.layout: files being written start with a dot and end so
BATCH_SIZES = (16, 32, 64, 128, 256)
SLOW_BATCH_SIZES = (64, 96, 128)  # with the slow model and long texts: seconds per batch
MAX_TEXT_BYTES = 65_536  # the worker's default cap (WorkerConfig.max_text_bytes)
READY = re.compile(r"model .* loaded")
OWNERSHIP = re.compile(r"partitions (assigned|revoked|lost): (\[.*\])")
# What the workers' logs say the chaos exercised (informational, per seed).
EXERCISED = {
    "session_expired": "Heartbeat session expired",
    "partitions_lost": "partitions lost:",
    "revoke_dropped": "not published within",
    "batch_dropped": "dropped partitions",
    "publish_race_lost": "was published by another worker first",
    "commit_failed": "offset commit failed",
    "quarantined": "damaged segment",
}


class HarnessError(Exception):
    """The harness itself could not do something (not a finding about the worker)."""


def log_stamp() -> str:
    """Wall-clock time formatted like the workers' log lines, to line them up."""
    now = datetime.now()
    return now.strftime("%Y-%m-%d %H:%M:%S,") + f"{now.microsecond // 1000:03d}"


# ---------------------------------------------------------------------------- the broker


class Broker:
    """The harness's own broker: scripts/dev-kafka.sh on another port and home."""

    def __init__(self, port: int, home: Path) -> None:
        if port in (SHARED_BROKER_PORT, SHARED_BROKER_PORT + 1):
            raise HarnessError(f"port {port} belongs to the shared broker; pick another")
        self.port = port
        self.home = home

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PIPELINE_KAFKA_PORT=str(self.port),
            PIPELINE_KAFKA_CONTROLLER_PORT=str(self.port + 1),
            PIPELINE_KAFKA_HOME=str(self.home),
        )
        return env

    def _script(self, command: str, timeout_s: float = 400) -> str:
        done = subprocess.run(
            [str(DEV_KAFKA), command],
            env=self._env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0:
            raise HarnessError(f"dev-kafka.sh {command} failed: {done.stderr.strip()[-2000:]}")
        return done.stdout.strip()

    def start(self) -> None:
        self._script("start")

    def restart(self) -> None:
        self._script("restart")

    def stop(self) -> None:
        self._script("stop")

    def wipe(self) -> None:
        """A freshly formatted broker: no topics, no internal topics, no groups."""
        self._script("wipe")
        self._script("start")

    def classpath(self) -> str:
        try:
            return self._script("classpath").splitlines()[-1]
        except (HarnessError, IndexError):
            return str(self.home / "libs" / "*")  # dev-kafka.sh without `classpath`


# ---------------------------------------------------------------------------- records

_WORDS_TEXT = (
    "river stone quiet harbour lantern copper orchard signal winter meadow engine "
    "letter violet thunder garden market silver compass shadow window ladder bridge "
    "story kettle forest island pocket mirror candle valley whisper anchor rhythm"
)
WORDS = _WORDS_TEXT.split()


def good_value(rng: random.Random, ident: str, long_texts: bool = False) -> bytes:
    count = rng.randint(200, 400) if long_texts else rng.randint(3, 40)
    words = " ".join(rng.choice(WORDS) for _ in range(count))
    value: dict[str, Any] = {"id": ident, "text": f"{words.capitalize()}. ({ident})"}
    if rng.random() < 0.3:
        value["lang"] = rng.choice(["en", "fr", "de"])
    return json.dumps(value).encode()


BadMaker = Callable[[random.Random, str], tuple[bytes | None, bytes | None]]

BAD_MAKERS: dict[str, BadMaker] = {
    "invalid-json": lambda rng, i: (None, b'{"id": "' + i.encode() + b'", "text": '),
    "empty-text": lambda rng, i: (None, json.dumps({"id": i, "text": ""}).encode()),
    "blank-text": lambda rng, i: (None, json.dumps({"id": i, "text": " \n\t "}).encode()),
    "missing-text": lambda rng, i: (None, json.dumps({"id": i, "body": "no text"}).encode()),
    "text-not-string": lambda rng, i: (None, json.dumps({"id": i, "text": 42}).encode()),
    "not-an-object": lambda rng, i: (None, json.dumps(["text", i]).encode()),
    "invalid-utf8": lambda rng, i: (None, b'{"text": "\xff\xfe ' + i.encode() + b'"}'),
    "tombstone": lambda rng, i: (f"tomb-{i}".encode(), None),
    "oversize": lambda rng, i: (None, json.dumps({"id": i, "text": "x" * 100_000}).encode()),
}


def bad_item(rng: random.Random, ident: str) -> tuple[bytes | None, bytes | None]:
    kinds = [k for k in BAD_MAKERS if k != "oversize" or rng.random() < 0.1]
    return BAD_MAKERS[rng.choice(kinds)](rng, ident)


def is_bad(value: bytes | None) -> bool:
    """The contract's definition of a bad record, written independently of the worker."""
    if value is None:
        return True
    try:
        obj = json.loads(value.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return True
    if not isinstance(obj, dict):
        return True
    text = obj.get("text")
    if not isinstance(text, str) or not text.strip():
        return True
    return len(text.encode("utf-8")) > MAX_TEXT_BYTES


def value_text(value: bytes | None) -> str | None:
    if is_bad(value):
        return None
    assert value is not None
    return json.loads(value.decode("utf-8"))["text"]


class Ids:
    """Unique record ids for one seed, shared by every publishing thread."""

    def __init__(self, seed: int) -> None:
        self._seed = seed
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def next(self) -> str:
        with self._lock:
            return f"py-{self._seed}-{next(self._counter)}"


@dataclass
class Published:
    """What the harness published (the check reads the topic itself; this is for the report)."""

    python: int = 0
    python_bad: int = 0
    java: int = 0
    java_committed_ids: set[str] = field(default_factory=set)
    java_aborted_ids: set[str] = field(default_factory=set)
    codecs: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


def make_items(
    rng: random.Random, ids: Ids, count: int, bad_ratio: float, long_texts: bool = False
) -> list[tuple[bytes | None, bytes | None, bool]]:
    items = []
    for _ in range(count):
        ident = ids.next()
        if rng.random() < bad_ratio:
            key, value = bad_item(rng, ident)
            items.append((key, value, True))
        else:
            key = ident.encode() if rng.random() < 0.5 else None
            items.append((key, good_value(rng, ident, long_texts), False))
    return items


@dataclass(frozen=True)
class Target:
    """Where a seed publishes, and what its texts look like."""

    bootstrap: str
    topic: str
    partitions: int
    long_texts: bool = False


def publish_python(
    target: Target,
    rng: random.Random,
    ids: Ids,
    count: int,
    published: Published,
    bad_ratio: float = 0.03,
) -> str:
    """Publishes `count` records with kafka-python and one random codec; returns the codec."""
    from kafka import KafkaProducer

    codec = rng.choice(CODECS)
    items = make_items(rng, ids, count, bad_ratio, target.long_texts)
    spread = rng.choice(["round-robin", "random", "one"])
    partitions, topic = target.partitions, target.topic
    producer = KafkaProducer(
        bootstrap_servers=target.bootstrap,
        acks="all",
        compression_type=None if codec == "none" else codec,
        linger_ms=rng.choice([0, 5, 50]),
        batch_size=rng.choice([16_384, 262_144]),
        retries=20,
        request_timeout_ms=20_000,
        delivery_timeout_ms=120_000,
        max_block_ms=60_000,
    )
    try:
        first = rng.randrange(partitions)
        for n, (key, value, _) in enumerate(items):
            part = {"round-robin": (first + n) % partitions, "one": first}.get(
                spread, rng.randrange(partitions)
            )
            producer.send(topic, key=key, value=value, partition=part)
        producer.flush(120)
    finally:
        producer.close(timeout=10)
    with published.lock:
        published.python += len(items)
        published.python_bad += sum(1 for *_, bad in items if bad)
        published.codecs[codec] += len(items)
    return codec


class JavaIds:
    """Disjoint --start-id ranges for successive Java producer runs."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()

    def take(self, count: int) -> int:
        with self._lock:
            start, self._next = self._next, self._next + count
            return start


def publish_java(
    broker: Broker,
    topic: str,
    partitions: int,
    rng: random.Random,
    java_ids: JavaIds,
    published: Published,
) -> dict[str, Any] | None:
    """One run of the official Java producer; None when the helper is absent."""
    if not FOREIGN_PRODUCER.exists():
        return None
    count = rng.randint(60, 300)
    codec = rng.choice(CODECS)
    transactions = rng.choice(["none", "commit", "abort-alternate", "abort-alternate"])
    args = [
        "java",
        "-cp",
        broker.classpath(),
        str(FOREIGN_PRODUCER),
        "--bootstrap",
        broker.bootstrap,
        "--topic",
        topic,
        "--count",
        str(count),
        "--compression",
        codec,
        "--transactions",
        transactions,
        "--per-transaction",
        str(rng.randint(3, 40)),
        "--partitions",
        str(partitions),
        "--start-id",
        str(java_ids.take(count)),
    ]
    done = subprocess.run(args, capture_output=True, text=True, timeout=240)
    if done.returncode != 0:
        raise HarnessError(f"ForeignProducer exited {done.returncode}: {done.stderr[-2000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    with published.lock:
        published.java += int(summary["sent"])
        published.java_committed_ids |= set(summary["committed_ids"])
        published.java_aborted_ids |= set(summary["aborted_ids"])
        published.codecs[f"java-{codec}"] += int(summary["sent"])
    return {
        "count": count,
        "compression": codec,
        "transactions": transactions,
        "aborted": len(summary["aborted_ids"]),
    }


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
        owned: set[tuple[str, int]] = set()
        for change, listed in OWNERSHIP.findall(self.log_text()):
            try:
                keys = {tuple(k) for k in ast.literal_eval(listed)}
            except (ValueError, SyntaxError):
                continue
            if change == "assigned":
                owned |= keys  # type: ignore[arg-type]
            else:
                owned -= keys
        return owned


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
        return [*args, "--until-end"] if until_end else args

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PIPELINE_BOOTSTRAP_SERVERS=self.settings.bootstrap,
            HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
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


class EventLog:
    """The harness's own timeline of a seed, stamped like the worker logs."""

    def __init__(self, path: Path, echo: bool = False) -> None:
        self.path = path
        self.echo = echo
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        line = f"{log_stamp()} {text}"
        with self._lock:
            self.lines.append(line)
            with open(self.path, "a") as out:
                out.write(line + "\n")
        if self.echo:
            print(f"    {line}", flush=True)


# ---------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Step:
    action: str  # start join ready sleep term kill stall broker publish java
    arg: float = 0.0

    def __str__(self) -> str:
        if self.action in ("sleep", "stall", "hiccup"):
            return f"{self.action}({self.arg:.1f}s)"
        if self.action in ("start", "join", "publish"):
            return f"{self.action}({int(self.arg)})"
        return self.action


@dataclass(frozen=True)
class Plan:
    scenario: str
    steps: list[Step]
    bulk_workers: int
    stop_before_bulk: bool  # else the bulk run joins the workers still running
    restart_during_bulk: bool
    fresh_broker: bool = False  # wiped before the seed: the first group operations wait

    @property
    def slow(self) -> bool:
        """The slow model and long texts: batches take seconds, rebalances find them."""
        return self.scenario == "slow-batches"


def _u(rng: random.Random, low: float, high: float) -> float:
    return round(rng.uniform(low, high), 1)


def _hiccup(rng: random.Random) -> Step:
    """A pause well inside the session timeout (a GC pause, a busy host)."""
    return Step("hiccup", _u(rng, 0.5, SESSION_TIMEOUT_MS / 2000))


def _stall(rng: random.Random) -> Step:
    return Step("stall", _u(rng, SESSION_TIMEOUT_MS / 1000 + 1.5, SESSION_TIMEOUT_MS / 1000 + 8))


def scenario_together(rng: random.Random) -> list[Step]:
    """Three or four workers at the same moment, then people leaving and one joining."""
    steps = [Step("start", rng.randint(3, 4)), Step("ready"), Step("sleep", _u(rng, 1, 6))]
    for _ in range(rng.randint(1, 2)):
        steps += [Step(rng.choice(["term", "kill"])), Step("sleep", _u(rng, 1, 5))]
    return [*steps, Step("join", 1), Step("sleep", _u(rng, 3, 8))]


def scenario_join(rng: random.Random) -> list[Step]:
    """One worker, then others joining mid-run, then leaving one by one."""
    steps = [Step("start", 1), Step("ready"), Step("sleep", _u(rng, 0.5, 4))]
    for _ in range(rng.randint(2, 3)):
        steps += [Step("join", 1), Step("sleep", _u(rng, 2, 7))]
    for _ in range(rng.randint(1, 3)):
        steps += [Step("term"), Step("sleep", _u(rng, 1, 4))]
    return steps


def scenario_kill(rng: random.Random) -> list[Step]:
    """SIGKILL at random moments, replacements joining."""
    steps = [Step("start", 2), Step("ready")]
    for _ in range(rng.randint(1, 3)):
        steps += [Step("sleep", _u(rng, 0.3, 6)), Step("kill"), Step("sleep", _u(rng, 0, 2))]
        steps.append(Step("join", 1))
    return [*steps, Step("sleep", _u(rng, 3, 8))]


def scenario_stall(rng: random.Random) -> list[Step]:
    """SIGSTOP past the session timeout, SIGCONT: the stalled worker must not double rows."""
    steps = [Step("start", rng.randint(2, 3)), Step("ready"), Step("sleep", _u(rng, 0.5, 5))]
    steps += [_stall(rng), Step("sleep", _u(rng, 1, 6))]
    if rng.random() < 0.5:
        steps += [Step("publish", rng.randint(100, 400)), _stall(rng), Step("sleep", _u(rng, 1, 5))]
    return steps


def scenario_broker(rng: random.Random) -> list[Step]:
    """A broker restart while workers run (and maybe another during the bulk run)."""
    steps = [Step("start", 2), Step("ready"), Step("sleep", _u(rng, 1, 6)), Step("broker")]
    steps += [Step("sleep", _u(rng, 2, 8))]
    if rng.random() < 0.4:
        steps += [Step("kill"), Step("join", 1), Step("sleep", _u(rng, 3, 6))]
    return steps


def scenario_foreign(rng: random.Random) -> list[Step]:
    """Java producer bursts (codecs, transactions, aborts) while workers run and move."""
    steps = [Step("start", 2), Step("ready"), Step("java"), Step("sleep", _u(rng, 0.5, 3))]
    steps += [Step(rng.choice(["term", "kill", "join"])), Step("java")]
    return [*steps, Step("sleep", _u(rng, 2, 6))]


def scenario_slow(rng: random.Random) -> list[Step]:
    """Batches that take seconds: members joining and leaving find them in flight."""
    steps = [Step("start", 2), Step("ready"), Step("sleep", _u(rng, 1, 4))]
    for _ in range(rng.randint(2, 3)):
        steps.append(rng.choice([Step("join", 1), Step("term"), Step("kill"), _hiccup(rng)]))
        steps.append(Step("sleep", _u(rng, 1, 5)))
    return [*steps, Step("join", 1), Step("sleep", _u(rng, 3, 8))]


def scenario_damage(rng: random.Random) -> list[Step]:
    """Segments damaged on disk (truncated, footer overwritten) and a dead host's temp file;
    workers crash and restart, and must read the damaged ranges again from Kafka."""
    steps = [Step("start", 2), Step("ready"), Step("sleep", _u(rng, 2, 6)), Step("damage")]
    steps += [Step("sleep", _u(rng, 0.5, 3)), Step("kill"), Step("damage"), Step("join", 1)]
    return [*steps, Step("sleep", _u(rng, 3, 7)), Step(rng.choice(["term", "kill"]))]


def scenario_storm(rng: random.Random) -> list[Step]:
    """A random mix of everything."""
    steps = [Step("start", rng.randint(1, 3)), Step("ready")]
    pool = ["join", "join", "term", "kill", "stall", "hiccup", "broker", "publish", "java"]
    pool.append("damage")
    for _ in range(rng.randint(4, 7)):
        action = rng.choice(pool)
        if action == "stall":
            steps.append(_stall(rng))
        elif action == "hiccup":
            steps.append(_hiccup(rng))
        elif action == "publish":
            steps.append(Step("publish", rng.randint(100, 500)))
        elif action == "join":
            steps.append(Step("join", 1))
        else:
            steps.append(Step(action))
        steps.append(Step("sleep", _u(rng, 0.5, 4)))
    return steps


SCENARIOS: dict[str, Callable[[random.Random], list[Step]]] = {
    "together": scenario_together,
    "join": scenario_join,
    "sigkill": scenario_kill,
    "stall": scenario_stall,
    "broker-restart": scenario_broker,
    "foreign": scenario_foreign,
    "storm": scenario_storm,
    "slow-batches": scenario_slow,
    "damage": scenario_damage,
}


def make_plan(seed: int, scenario: str) -> Plan:
    rng = random.Random(seed * 1_000_003 + 17)
    steps = SCENARIOS[scenario](rng)
    return Plan(
        scenario=scenario,
        steps=steps,
        bulk_workers=rng.randint(1, 2),
        stop_before_bulk=rng.random() < 0.6,
        restart_during_bulk=scenario == "broker-restart" and rng.random() < 0.5,
        # From its own generator, so that adding it changed no other plan.
        fresh_broker=scenario == "broker-restart" and random.Random(seed * 31 + 7).random() < 0.4,
    )


def scenario_for(seed: int, chosen: Sequence[str] | None, index: int) -> str:
    if chosen:
        return chosen[index % len(chosen)]
    names = list(SCENARIOS)
    return names[(seed - 1) % len(names)]


# ---------------------------------------------------------------------------- reading back


def read_topic(bootstrap: str, topic: str, timeout_s: float = 120) -> list[Any]:
    """Every committed record of a topic (read_committed, no group), beginning to end."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        isolation_level="read_committed",
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=4 * 1024 * 1024,
    )
    try:
        numbers = consumer.partitions_for_topic(topic)
        if not numbers:
            return []
        partitions = [TopicPartition(topic, p) for p in sorted(numbers)]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        ends = consumer.end_offsets(partitions)
        records: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < end for tp, end in ends.items()):
            if time.monotonic() > deadline:
                raise HarnessError(f"reading {topic} did not reach its end offsets {ends}")
            for batch in consumer.poll(timeout_ms=500).values():
                records += batch
        return records
    finally:
        consumer.close()


def topic_exists(bootstrap: str, topic: str) -> bool:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    try:
        return topic in consumer.topics()
    finally:
        consumer.close()


def group_committed(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int]:
    """The group's committed offsets (read without joining the group)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        found = {p: consumer.committed(TopicPartition(topic, p)) for p in range(partitions)}
    finally:
        consumer.close(autocommit=False)
    return {p: offset for p, offset in found.items() if offset is not None and offset >= 0}


@dataclass
class RowScan:
    """What the Parquet files under DIR/vectors hold, read with pyarrow alone."""

    rows: list[tuple[int, int, str]] = field(default_factory=list)  # partition, offset, text
    other_topics: int = 0  # rows naming another topic than the seed's
    bad_vectors: int = 0  # not finite, or not of unit length (the tiny model normalises)
    files: int = 0
    unreadable: list[str] = field(default_factory=list)  # damaged segments left in place


def parquet_rows(output: Path, topic: str) -> RowScan:
    import numpy as np
    import pyarrow.parquet as pq

    scan = RowScan()
    columns = ["topic", "partition", "offset", "text", "embedding"]
    for path in sorted((output / "vectors").glob("*.parquet")):
        scan.files += 1
        try:
            table = pq.read_table(path, columns=columns)
        except (OSError, ValueError) as exc:  # pyarrow's errors: its rows count as absent
            scan.unreadable.append(f"{path.name}: {exc}")
            continue
        if table.num_rows == 0:
            continue
        mine = [t == topic for t in table["topic"].to_pylist()]
        scan.other_topics += mine.count(False)
        scan.rows += [
            row
            for row, ok in zip(
                zip(
                    table["partition"].to_pylist(),
                    table["offset"].to_pylist(),
                    table["text"].to_pylist(),
                    strict=True,
                ),
                mine,
                strict=True,
            )
            if ok
        ]
        flat = table["embedding"].combine_chunks().flatten().to_numpy(zero_copy_only=False)
        vectors = flat.reshape(table.num_rows, -1)
        norms = np.linalg.norm(vectors, axis=1)
        scan.bad_vectors += int((~np.isfinite(norms) | (np.abs(norms - 1) > 1e-3)).sum())
    return scan


def dead_letters(records: Iterable[Any], topic: str) -> Counter[tuple[int, int]]:
    found: Counter[tuple[int, int]] = Counter()
    for record in records:
        headers = {k: v.decode("utf-8", "replace") for k, v in (record.headers or [])}
        if headers.get("source.topic") != topic:
            continue
        found[(int(headers["source.partition"]), int(headers["source.offset"]))] += 1
    return found


def index_entries(output: Path, topic: str) -> Counter[tuple[int, int]] | None:
    """(partition, offset) of each FAISS index entry; None when there is no index."""
    from sinks.index.store import IndexStore, decode_id

    if not (output / "index").is_dir():
        return None
    store = IndexStore(output)
    store.load()
    if store.meta is None:
        return None
    numbers = {no: name for name, no in store.meta.topics.items()}
    entries: Counter[tuple[int, int]] = Counter()
    for vector_id in store.ids():
        topic_no, partition, offset = decode_id(int(vector_id))
        if numbers.get(topic_no) == topic:
            entries[(partition, offset)] += 1
    return entries


# ---------------------------------------------------------------------------- the check


def ranges(keys: Iterable[tuple[int, int]]) -> dict[int, list[str]]:
    """{partition: ["a-b", "c", ...]} of (partition, offset) pairs, for reports."""
    by_partition: dict[int, list[int]] = {}
    for partition, offset in sorted(set(keys)):
        by_partition.setdefault(partition, []).append(offset)
    result: dict[int, list[str]] = {}
    for partition, offsets in by_partition.items():
        spans: list[list[int]] = []
        for offset in offsets:
            if spans and offset == spans[-1][1] + 1:
                spans[-1][1] = offset
            else:
                spans.append([offset, offset])
        result[partition] = [f"{a}-{b}" if a != b else str(a) for a, b in spans]
    return result


@dataclass
class Verdict:
    records: int = 0
    bad_records: int = 0
    rows: int = 0
    dead_letters: int = 0
    lost: list[tuple[int, int]] = field(default_factory=list)
    doubled: list[tuple[int, int]] = field(default_factory=list)
    phantom: list[tuple[int, int]] = field(default_factory=list)
    misrouted: list[tuple[int, int]] = field(default_factory=list)  # good dead-lettered, bad rows
    mismatched: list[tuple[int, int]] = field(default_factory=list)  # row text != record text
    dead_letter_repeats: int = 0  # informational (a crash between flush and publish)
    other_topics: int = 0  # rows naming another topic
    bad_vectors: int = 0  # embeddings not finite or not unit length
    unreadable: list[str] = field(default_factory=list)  # damaged segments still in vectors/
    index: dict[str, int] = field(default_factory=dict)
    commits_short: dict[int, str] = field(default_factory=dict)
    reader_suspect: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (
            self.lost
            or self.doubled
            or self.phantom
            or self.misrouted
            or self.mismatched
            or any(self.index.values())
            or self.commits_short
            or self.other_topics
            or self.bad_vectors
            or self.unreadable
        )

    def problems(self) -> list[str]:
        found = []
        for name in ("lost", "doubled", "phantom", "misrouted", "mismatched"):
            keys = getattr(self, name)
            if keys:
                found.append(f"{name} {len(keys)}: {ranges(keys)}")
        found += [f"index {k} {v}" for k, v in self.index.items() if v]
        if self.commits_short:
            found.append(f"commits short of the end: {self.commits_short}")
        if self.other_topics:
            found.append(f"rows naming another topic: {self.other_topics}")
        if self.bad_vectors:
            found.append(f"embeddings not finite or not of unit length: {self.bad_vectors}")
        found += [f"unreadable segment left in vectors/: {u[:300]}" for u in self.unreadable]
        return found + [f"reader: {s}" for s in self.reader_suspect]


def check_records(
    real: dict[tuple[int, int], bytes | None],
    rows: list[tuple[int, int, str]],
    dlq: Counter[tuple[int, int]],
) -> Verdict:
    """Every real record in exactly one row, or (bad records) in the dead-letter topic."""
    verdict = Verdict(records=len(real), rows=len(rows), dead_letters=sum(dlq.values()))
    row_count: Counter[tuple[int, int]] = Counter((p, o) for p, o, _ in rows)
    row_text = {(p, o): t for p, o, t in rows}
    for key, value in sorted(real.items()):
        bad = is_bad(value)
        verdict.bad_records += bad
        in_rows, in_dlq = row_count[key], dlq[key]
        if not in_rows and not in_dlq:
            verdict.lost.append(key)
        elif in_rows > 1 or (in_rows and in_dlq):
            verdict.doubled.append(key)
        elif (bad and in_rows) or (not bad and in_dlq):
            verdict.misrouted.append(key)
        elif in_rows and row_text[key] != value_text(value):
            verdict.mismatched.append(key)
        if bad and in_dlq > 1 and not in_rows:
            verdict.dead_letter_repeats += in_dlq - 1
    verdict.phantom = sorted((set(row_count) | set(dlq)) - set(real))
    return verdict


def check_index(verdict: Verdict, rows: list[tuple[int, int, str]], index: Counter | None) -> None:
    row_keys = {(p, o) for p, o, _ in rows}
    if index is None:
        verdict.index = {"absent": 1 if row_keys else 0}
        return
    verdict.index = {
        "missing": len(row_keys - set(index)),
        "doubled": sum(1 for n in index.values() if n > 1),
        "extra": len(set(index) - row_keys),
    }


def check_commits(verdict: Verdict, committed: dict[int, int], ends: dict[int, int]) -> None:
    for partition, end in sorted(ends.items()):
        offset = committed.get(partition)
        if offset is None or offset < end:
            verdict.commits_short[partition] = f"committed {offset}, end {end}"


def check_java(verdict: Verdict, real: dict[tuple[int, int], bytes | None], pub: Published) -> None:
    """Cross-checks the read_committed reader with what the Java producer reported."""
    if not pub.java:
        return
    seen: Counter[str] = Counter()
    for value in real.values():
        if value is not None and b'"java-' in value:
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                seen[str(json.loads(value)["id"])] += 1
    if set(seen) != pub.java_committed_ids:
        missing = len(pub.java_committed_ids - set(seen))
        aborted = len(set(seen) & pub.java_aborted_ids)
        verdict.reader_suspect.append(
            f"java committed ids missing from the topic: {missing}, aborted ids read: {aborted}"
        )
    if any(n > 1 for n in seen.values()):
        verdict.reader_suspect.append("a java id appears at two offsets")


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    """End offsets (read_committed) per partition, for the commit check."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed")
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or []]
        return {tp.partition: off for tp, off in consumer.end_offsets(partitions).items()}
    finally:
        consumer.close()


def run_cli(args: list[str], bootstrap: str, timeout_s: float = 180) -> tuple[int, str, str]:
    env = dict(os.environ, PIPELINE_BOOTSTRAP_SERVERS=bootstrap, HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [PYTHON, "-m", "pipeline.cli", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return done.returncode, done.stdout, done.stderr


def has_audit(bootstrap: str) -> bool:
    rc, _, _ = run_cli(["audit", "--help"], bootstrap, timeout_s=60)
    return rc == 0


def run_audit(bootstrap: str, output: Path, group: str, topic: str, clean: bool) -> dict[str, Any]:
    """`pipeline audit --json`, and whether its verdict agrees with the harness's."""
    if not has_audit(bootstrap):
        return {"present": False}
    args = ["audit", "--output", str(output), "--group", group, "--topic", topic, "--json"]
    rc, out, err = run_cli(args, bootstrap)
    result: dict[str, Any] = {"present": True, "rc": rc, "agrees": (rc == 0) == clean}
    if rc not in (0, 1):
        result["agrees"] = False
        result["error"] = (err.strip().splitlines() or [""])[-1]
    try:
        report = json.loads(out)
    except ValueError:
        result["stdout"] = out[-2000:]
        return result
    result["totals"] = report.get("totals")
    result["partitions"] = [
        {k: p.get(k) for k in ("partition", "committed", "end", "missing", "doubled", "ok")}
        for p in report.get("partitions", [])
        if not p.get("ok", True)
    ]
    return result


# ---------------------------------------------------------------------------- one seed


@dataclass
class SeedResult:
    seed: int
    scenario: str
    partitions: int
    events: list[str]
    steps: int = 0
    plan: list[str] = field(default_factory=list)
    records: int = 0
    bad_records: int = 0
    rows: int = 0
    java_aborted: int = 0
    lost: int = 0
    doubled: int = 0
    phantom: int = 0
    misrouted: int = 0
    mismatched: int = 0
    dead_letter_repeats: int = 0
    index: dict[str, int] = field(default_factory=dict)
    audit: dict[str, Any] = field(default_factory=dict)
    workers: dict[str, Any] = field(default_factory=dict)
    exercised: dict[str, int] = field(default_factory=dict)
    temp_files_left: int = 0
    quarantined: int = 0
    problems: list[str] = field(default_factory=list)
    harness_error: str | None = None
    seconds: float = 0.0
    work_dir: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems and self.harness_error is None

    def line(self) -> str:
        status = "OK" if self.ok else ("ERROR" if self.harness_error else "FAIL")
        audit = (
            "-"
            if not self.audit.get("present")
            else ("agree" if self.audit.get("agrees") else "DISAGREE")
        )
        return (
            f"seed {self.seed:>3} {self.scenario:<14} p={self.partitions} "
            f"events={self.steps:>2} records={self.records:>5} (bad {self.bad_records}, "
            f"aborted {self.java_aborted}) lost={self.lost} doubled={self.doubled} "
            f"phantom={self.phantom} audit={audit} {self.seconds:5.1f}s {status}"
        )


class SeedRun:
    """Publishes, runs the plan, finishes in bulk mode and checks, for one seed."""

    def __init__(
        self, seed: int, scenario: str, broker: Broker, model: Path, root: Path, args: Any
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.plan = make_plan(seed, scenario)
        self.broker = broker
        self.args = args
        self.dir = root / f"seed-{seed:03d}-{scenario}"
        shutil.rmtree(self.dir, ignore_errors=True)
        (self.dir / "logs").mkdir(parents=True)
        suffix = uuid.uuid4().hex[:6]
        self.topic = f"chaos-{seed}-{suffix}"
        self.group = f"chaos-g-{seed}-{suffix}"
        self.output = self.dir / "out"
        self.partitions = self.rng.randint(2, 4)
        self.events = EventLog(self.dir / "events.log", echo=args.verbose)
        self.published = Published()
        self.ids = Ids(seed)
        self.java_ids = JavaIds()
        self.target = Target(broker.bootstrap, self.topic, self.partitions, self.plan.slow)
        if self.plan.slow:
            model = ensure_tiny_model(variant="slow")
        self.fleet = Fleet(self._worker_settings(model), self.dir / "logs", self.events)
        self.result = SeedResult(
            seed,
            scenario,
            self.partitions,
            [],
            steps=sum(1 for s in self.plan.steps if s.action not in ("sleep", "ready")),
            plan=[str(s) for s in self.plan.steps],
            work_dir=str(self.dir),
        )
        self.trickle: Trickle | None = None

    def _worker_settings(self, model: Path) -> WorkerSettings:
        rng = self.rng
        mixed = rng.random() < 0.3  # a rolling change: workers with different batch sizes
        choices = SLOW_BATCH_SIZES if self.plan.slow else BATCH_SIZES
        sizes = choices if mixed else (rng.choice(choices),)
        return WorkerSettings(
            topic=self.topic,
            group=self.group,
            output=self.output,
            model=model,
            bootstrap=self.broker.bootstrap,
            log_level=self.args.log_level,
            batch_sizes=sizes,
            poll_timeout_ms=rng.choice([100, 250, 500]),
            max_in_flight=rng.choice([1, 2, 2, 3]),
            index_sync_interval_s=rng.choice([1.0, 5.0, 30.0]),
        )

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> SeedResult:
        started = time.monotonic()
        try:
            self._create_topic()
            self._publish_backlog()
            self._run_plan()
            self._finish_in_bulk()
            self._check()
        except HarnessError as exc:
            self.result.harness_error = str(exc)
        except Exception as exc:  # a harness bug: report it, never a silent pass
            self.result.harness_error = f"{type(exc).__name__}: {exc}"
        finally:
            if self.trickle is not None and self.trickle.is_alive():
                self.trickle.finish()
            self.fleet.kill_all()
            self.result.seconds = time.monotonic() - started
            self.result.events = list(self.events.lines)
        self._save()
        return self.result

    def _create_topic(self) -> None:
        from kafka import KafkaAdminClient
        from kafka.admin import NewTopic

        if self.plan.fresh_broker and self.args.keep_evidence:
            self.events.write("fresh broker skipped: an earlier seed failed, its topics stay")
        elif self.plan.fresh_broker:
            self.broker.wipe()
            self.events.write("broker wiped: a fresh broker, no internal topics yet")
        admin = KafkaAdminClient(bootstrap_servers=self.broker.bootstrap)
        try:
            admin.create_topics([NewTopic(self.topic, self.partitions, 1)])
        finally:
            admin.close()
        self.events.write(
            f"topic {self.topic} ({self.partitions} partitions), group {self.group}, "
            f"plan {[str(s) for s in self.plan.steps]}, bulk {self.plan.bulk_workers} "
            f"(stop first: {self.plan.stop_before_bulk}, "
            f"broker restart: {self.plan.restart_during_bulk}, "
            f"fresh broker: {self.plan.fresh_broker})"
        )

    def _publish(self, rng: random.Random, count: int) -> None:
        codec = publish_python(self.target, rng, self.ids, count, self.published)
        self.events.write(f"published {count} records ({codec})")

    def _publish_java(self, rng: random.Random) -> None:
        done = publish_java(
            self.broker, self.topic, self.partitions, rng, self.java_ids, self.published
        )
        if done is not None:
            self.events.write(f"java producer: {done}")

    def _publish_backlog(self) -> None:
        target = self.rng.randint(200, 400) if self.plan.slow else self.rng.randint(300, 1500)
        sent = 0
        while sent < target:
            chunk = min(target - sent, self.rng.randint(50, 600))
            self._publish(self.rng, chunk)
            sent += chunk
        if self.plan.scenario == "foreign" or self.rng.random() < 0.5:
            self._publish_java(self.rng)

    def _run_plan(self) -> None:
        chunk = (1, 6) if self.plan.slow else (5, 60)
        self.trickle = Trickle(self._publish, self.seed, chunk)
        self.trickle.start()
        for step in self.plan.steps:
            self._step(step)
            self.fleet.reap()
            if self.trickle.error is not None:
                raise HarnessError(f"publishing while workers run failed: {self.trickle.error}")
        self.trickle.finish()
        if self.trickle.error is not None:
            raise HarnessError(f"publishing while workers run failed: {self.trickle.error}")

    def _step(self, step: Step) -> None:
        rng, fleet = self.rng, self.fleet
        if step.action in ("start", "join"):
            fleet.start(int(step.arg), rng)
        elif step.action == "ready":
            fleet.wait_ready(fleet.live())
        elif step.action == "sleep":
            time.sleep(step.arg)
        elif step.action in ("term", "kill"):
            self._signal(signal.SIGTERM if step.action == "term" else signal.SIGKILL)
        elif step.action in ("stall", "hiccup"):
            self._stall(step.arg)
        elif step.action == "broker":
            self._restart_broker()
        elif step.action == "publish":
            self._publish(rng, int(step.arg))
        elif step.action == "java":
            self._publish_java(rng)
        elif step.action == "damage":
            self._damage()
        else:
            raise HarnessError(f"unknown step {step}")

    def _signal(self, sig: signal.Signals) -> None:
        victim = self.fleet.pick(self.rng)
        if victim is None:
            self.events.write(f"{sig.name}: no live worker, skipped")
            return
        self.fleet.send(victim, sig)

    def _stall(self, seconds: float) -> None:
        victim = self.fleet.pick(self.rng)
        if victim is None:
            self.events.write("stall: no live worker, skipped")
            return
        self.fleet.send(victim, signal.SIGSTOP)
        time.sleep(seconds)
        self.fleet.send(victim, signal.SIGCONT)

    def _damage(self) -> None:
        """Damages one published segment in place, and leaves a dead host's temp file."""
        segments = sorted((self.output / "vectors").glob("*.parquet"))
        if not segments:
            self.events.write("damage: no segment yet, skipped")
            return
        victim = self.rng.choice(segments)
        size = victim.stat().st_size
        if self.rng.random() < 0.5:
            os.truncate(victim, self.rng.randint(0, size // 2))
            how = "truncated"
        else:
            with open(victim, "r+b") as fh:  # the footer and its length: unreadable
                fh.seek(max(0, size - 64))
                fh.write(bytes(min(64, size)))
            how = "footer zeroed"
        stale = victim.with_name(f".{victim.name}.1.gone-host.4242.dead{TMP_SUFFIX}")
        stale.write_bytes(b"half a file from a container that no longer exists")
        week_ago = time.time() - 7 * 86_400
        os.utime(stale, (week_ago, week_ago))
        self.events.write(f"damage: {victim.name} {how} (was {size} bytes); stale {stale.name}")

    def _restart_broker(self) -> None:
        if self.trickle is not None:
            self.trickle.pause()
        self.events.write("broker restart: begin")
        self.broker.restart()
        self.events.write("broker restart: done")
        if self.trickle is not None:
            self.trickle.resume()

    def _finish_in_bulk(self) -> None:
        fleet, plan = self.fleet, self.plan
        if plan.stop_before_bulk:
            self._stop_workers(fleet.live())
        bulk = fleet.start(plan.bulk_workers, self.rng, until_end=True)
        if plan.restart_during_bulk:
            fleet.wait_ready(bulk)
            time.sleep(self.rng.uniform(0.5, 3))
            self._restart_broker()
        stuck = fleet.wait(bulk, self.args.bulk_timeout_s)
        if stuck:
            names = [w.name for w in stuck]
            self.result.problems.append(
                f"--until-end did not finish within {self.args.bulk_timeout_s:.0f}s: {names}"
            )
        fleet.terminate_all()
        self._judge_exits()

    def _stop_workers(self, workers: list[WorkerProc]) -> None:
        for worker in workers:
            if worker.stopped:
                self.fleet.send(worker, signal.SIGCONT)
            self.fleet.send(worker, signal.SIGTERM)
        self.fleet.wait(workers, 90)

    def _judge_exits(self) -> None:
        self.fleet.reap()
        exercised: Counter[str] = Counter()
        for worker in self.fleet.workers:
            text = worker.log_text()
            exercised.update({k: text.count(v) for k, v in EXERCISED.items() if v in text})
            self.result.workers[worker.name] = {
                "rc": worker.returncode,
                "killed": worker.killed,
                "terminated": worker.terminated,
                "until_end": worker.until_end,
                "batch_size": worker.batch_size,
                "tracebacks": text.count("Traceback"),
            }
            if worker.killed:
                continue
            if worker.returncode != 0:
                tail = " | ".join(text.strip().splitlines()[-3:])
                self.result.problems.append(
                    f"{worker.name} exited {worker.returncode} unexpectedly: {tail[-400:]}"
                )
            elif not worker.terminated and not worker.until_end:
                self.result.problems.append(f"{worker.name} exited 0 on its own, unasked")
        self.result.exercised = dict(exercised)

    # -- the check -------------------------------------------------------------------------

    def _check(self) -> None:
        bootstrap = self.broker.bootstrap
        records = read_topic(bootstrap, self.topic)
        real = {(r.partition, r.offset): r.value for r in records}
        dlq_topic = f"{self.topic}.dlq"
        dlq_records = read_topic(bootstrap, dlq_topic) if topic_exists(bootstrap, dlq_topic) else []
        scan = parquet_rows(self.output, self.topic)
        rows = scan.rows
        verdict = check_records(real, rows, dead_letters(dlq_records, self.topic))
        check_index(verdict, rows, index_entries(self.output, self.topic))
        verdict.other_topics, verdict.bad_vectors = scan.other_topics, scan.bad_vectors
        verdict.unreadable = scan.unreadable
        committed = group_committed(bootstrap, self.group, self.topic, self.partitions)
        check_commits(verdict, committed, end_offsets(bootstrap, self.topic))
        check_java(verdict, real, self.published)
        self._record(verdict)
        self._check_leftovers()
        self.result.audit = run_audit(bootstrap, self.output, self.group, self.topic, verdict.clean)

    def _check_leftovers(self) -> None:
        """Temp files left in DIR/vectors, and what went to DIR/quarantine (informational),
        except a dead host's week-old temp file, which a later start-up must have removed."""
        vectors = self.output / "vectors"
        left = sorted(p.name for p in vectors.glob(f".*{TMP_SUFFIX}")) if vectors.is_dir() else []
        self.result.temp_files_left = len(left)
        self.result.quarantined = len(list((self.output / "quarantine").glob("*.json")))
        planted = [name for name in left if ".gone-host." in name]
        if planted:
            self.result.problems.append(f"stale temp files of a dead host not removed: {planted}")

    def _record(self, verdict: Verdict) -> None:
        r = self.result
        r.records, r.bad_records, r.rows = verdict.records, verdict.bad_records, verdict.rows
        r.java_aborted = len(self.published.java_aborted_ids)
        r.lost, r.doubled, r.phantom = len(verdict.lost), len(verdict.doubled), len(verdict.phantom)
        r.misrouted, r.mismatched = len(verdict.misrouted), len(verdict.mismatched)
        r.dead_letter_repeats = verdict.dead_letter_repeats
        r.index = verdict.index
        r.problems = verdict.problems() + r.problems

    def _save(self) -> None:
        (self.dir / "result.json").write_text(json.dumps(asdict(self.result), indent=1))

    def clean_up(self) -> None:
        """Deletes the seed's topics (a passing seed's files stay for inspection)."""
        from kafka import KafkaAdminClient

        with contextlib.suppress(Exception):
            admin = KafkaAdminClient(bootstrap_servers=self.broker.bootstrap)
            try:
                existing = set(admin.list_topics())
                doomed = [t for t in (self.topic, f"{self.topic}.dlq") if t in existing]
                if doomed:
                    admin.delete_topics(doomed)
            finally:
                admin.close()


# ---------------------------------------------------------------------------- main


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            low, high = part.split("-", 1)
            seeds += range(int(low), int(high) + 1)
        else:
            seeds.append(int(part))
    if not seeds:
        raise argparse.ArgumentTypeError(f"no seeds in {text!r}")
    return seeds


def parse_scenarios(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}"
        )
    return names


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Seeded chaos scenarios against a real broker, each checked independently.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--seeds", type=parse_seeds, default=parse_seeds("1-7"))
    parser.add_argument(
        "--scenario",
        type=parse_scenarios,
        default=None,
        help=f"comma-separated, cycled over the seeds [default: by seed: {', '.join(SCENARIOS)}]",
    )
    parser.add_argument("--keep-going", action="store_true", help="run every seed after a failure")
    parser.add_argument("--json", type=Path, default=None, help="write every result here")
    parser.add_argument("--port", type=int, default=19092, help="the harness broker's port")
    parser.add_argument("--kafka-home", type=Path, default=CACHE / "chaos-kafka")
    parser.add_argument("--work-dir", type=Path, default=None, help="[default: a new temp dir]")
    parser.add_argument("--model", type=Path, default=None, help="[default: the tiny model]")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO"])
    parser.add_argument("--bulk-timeout-s", type=float, default=240.0)
    parser.add_argument("--keep-broker", action="store_true", help="leave the broker running")
    parser.add_argument("--keep-topics", action="store_true", help="do not delete seed topics")
    parser.add_argument("-v", "--verbose", action="store_true", help="print events as they happen")
    return parser.parse_args(argv)


def code_version() -> str:
    """The commit under test, and whether the working tree differs from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head or 'unknown'}{' (modified)' if dirty else ''}"


def summarize(results: list[SeedResult], seconds: float) -> dict[str, Any]:
    failed = [r for r in results if not r.ok]
    return {
        "seeds": len(results),
        "passed": len(results) - len(failed),
        "failed": [r.seed for r in failed],
        "lost": sum(r.lost for r in results),
        "doubled": sum(r.doubled for r in results),
        "phantom": sum(r.phantom for r in results),
        "misrouted": sum(r.misrouted for r in results),
        "mismatched": sum(r.mismatched for r in results),
        "records": sum(r.records for r in results),
        "audit_disagreements": [
            r.seed for r in results if r.audit.get("present") and not r.audit.get("agrees")
        ],
        "seconds": round(seconds, 1),
        # How many seeds exercised each path (from the workers' logs).
        "exercised_seeds": dict(
            sum((Counter({k: 1 for k, n in r.exercised.items() if n}) for r in results), Counter())
        ),
    }


def print_failure(result: SeedResult) -> None:
    if result.harness_error:
        print(f"    harness error: {result.harness_error}")
    for problem in result.problems:
        print(f"    {problem[:600]}")
    print(f"    work dir (events.log, logs/): {result.work_dir}")


@contextlib.contextmanager
def running_broker(broker: Broker, keep: bool) -> Iterator[Broker]:
    broker.start()
    try:
        yield broker
    finally:
        if not keep:
            with contextlib.suppress(HarnessError, subprocess.TimeoutExpired):
                broker.stop()


def run_seeds(args: argparse.Namespace, broker: Broker, model: Path, root: Path) -> list[Any]:
    results: list[SeedResult] = []
    args.keep_evidence = args.keep_topics  # no broker wipe once a topic is worth keeping
    for index, seed in enumerate(args.seeds):
        scenario = scenario_for(seed, args.scenario, index)
        run = SeedRun(seed, scenario, broker, model, root, args)
        result = run.run()
        results.append(result)
        print(result.line(), flush=True)
        args.keep_evidence = args.keep_evidence or not result.ok or args.keep_topics
        if result.ok:
            if not args.keep_topics:
                run.clean_up()
        else:
            print_failure(result)
            if not args.keep_going:
                break
        if args.json:
            write_json(args.json, results, None)
    return results


def write_json(path: Path, results: list[SeedResult], summary: dict[str, Any] | None) -> None:
    payload = {"summary": summary, "results": [asdict(r) for r in results]}
    path.write_text(json.dumps(payload, indent=1, default=str))


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    root = args.work_dir or Path(f"/tmp/chaos-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    root.mkdir(parents=True, exist_ok=True)
    model = ensure_tiny_model(args.model)
    broker = Broker(args.port, args.kafka_home)
    print(f"chaos: broker {broker.bootstrap} (home {broker.home}), work dir {root}", flush=True)
    started, code = time.monotonic(), code_version()
    print(f"chaos: code under test {code}", flush=True)
    try:
        with running_broker(broker, args.keep_broker):
            results = run_seeds(args, broker, model, root)
    except HarnessError as exc:
        print(f"chaos: error: {exc}", file=sys.stderr)
        return 2
    summary = summarize(results, time.monotonic() - started)
    summary["code"] = {"start": code, "end": code_version()}
    print("summary: " + json.dumps(summary), flush=True)
    if args.json:
        write_json(args.json, results, summary)
    failed = summary["failed"] or len(results) < len(args.seeds)
    if failed:
        print(f"chaos: FAILED; work dir {root}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
