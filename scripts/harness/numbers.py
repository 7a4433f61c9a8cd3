"""Medians, percentiles and spreads of a benchmark's measurements, and its JSON."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def pct(values: Sequence[float], percent: float) -> float | None:
    """The `percent` percentile (inclusive method); None for no values."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(percent) - 1]


def median_by(items: list[T], key: Callable[[T], float]) -> T:
    """The item whose key is the median (the lower middle of an even count)."""
    ordered = sorted(items, key=key)
    return ordered[(len(ordered) - 1) // 2]


def spread(values: Sequence[float]) -> str:
    """'lowest-highest' of repeated measurements, to show beside their median."""
    return f"{min(values):.0f}-{max(values):.0f}" if values else "-"


def ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else 0.0


def write_json(path: Path | None, value: Any) -> None:
    if path is not None:
        path.write_text(json.dumps(value, indent=2, default=str) + "\n")


@dataclass(frozen=True)
class Rate:
    """One variant's throughput; key is a, b, c, d_steady or d_wall."""

    key: str
    name: str
    texts: int
    seconds: float
    per_s: float

    @classmethod
    def timed(cls, key: str, name: str, texts: int, seconds: float) -> Rate:
        return cls(key, name, texts, seconds, texts / seconds if seconds > 0 else 0.0)


@dataclass(frozen=True)
class Timer:
    """Times one variant's encode of a benchmark's texts, as often as asked: its model
    stays loaded (the benchmark times the contenders for "best" again each round)."""

    key: str
    name: str
    texts: int
    encode: Callable[[], Any]

    def timed(self) -> tuple[Rate, Any]:
        """The rate of one encode, and what it returned."""
        started = time.perf_counter()
        result = self.encode()
        return Rate.timed(self.key, self.name, self.texts, time.perf_counter() - started), result

    def __call__(self) -> Rate:
        return self.timed()[0]


@dataclass(frozen=True)
class Padding:
    label: str
    real_tokens: int
    computed_tokens: int
    target: float | None = None

    @property
    def efficiency(self) -> float:
        return self.real_tokens / self.computed_tokens if self.computed_tokens else 1.0


def load_note() -> str:
    """A warning when other work shares the CPUs: thread pools then stall on each other."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load < 0.5 * cores:
        return ""
    return f"load average {load:.1f} on {cores} cores: other work shares the CPUs"
