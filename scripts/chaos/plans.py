"""The scenarios: a seeded schedule of events (start together, join, SIGKILL, SIGSTOP
past the session timeout, broker restarts, damage) for each seed."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from chaos.common import SESSION_TIMEOUT_MS, log_stamp


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
    def bad_ratio(self) -> float:
        """The share of bad records published: one in eight where dead letters are the test."""
        return 0.125 if self.scenario == "dead-letters" else 0.03

    @property
    def failpoints(self) -> str:
        """Pauses the workers make (pipeline.core.failpoints): where dead letters are the
        test, half a second between a batch's dead letters and its publish, the window a
        SIGKILL or a stall must hit to send a dead letter twice."""
        return "write.after_dead_letters=0.5" if self.scenario == "dead-letters" else ""

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


def scenario_dead_letters(rng: random.Random) -> list[Step]:
    """One record in eight bad; a worker stalled past its session timeout and resumed,
    others SIGKILLed at random instants: each bad record once in the dead-letter topic."""
    steps = [Step("start", rng.randint(2, 3)), Step("ready"), Step("sleep", _u(rng, 0.5, 3))]
    for n in range(rng.randint(4, 6)):
        if n == 1:
            steps.append(_stall(rng))
        steps += [Step("kill"), Step("join", 1), Step("sleep", _u(rng, 0.3, 4))]
        if rng.random() < 0.4:
            steps.append(Step("publish", rng.randint(100, 300)))
    return [*steps, Step("sleep", _u(rng, 2, 5))]


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
    "dead-letters": scenario_dead_letters,
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
