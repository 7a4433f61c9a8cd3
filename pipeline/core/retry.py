"""Trying again after a failure: one schedule of pauses, and the two ways the
pipeline waits them out.

- `retry(call, on=..., attempts=..., pause=...)` blocks: it calls again after a
  pause while the failure is one of the classes (and `when`) given, at most
  `attempts` calls in all, and raises the last failure as it was. Any other
  exception goes straight through: a retry loop must not turn a bug into "the
  store kept failing".
- `RetryGate` never blocks, for loops that have other work between tries (the poll
  loop's offset commits, the embed stage's calls to a shared cache): it says
  whether to try now, and since when the failures in a row go on (what a deadline
  is measured from).

Pauses come from `Backoff` (or any function of the failures in a row so far).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
Pause = Callable[[int], float]  # seconds to wait after the n-th failure in a row (n >= 1)


@dataclass(frozen=True)
class Backoff:
    """`first_s` after the first failure in a row, times `factor` after each further
    one, at most `max_s`; each pause stretched by a random share of itself up to
    `jitter`, so that writers that failed together do not come back together."""

    first_s: float
    factor: float = 2.0
    max_s: float = math.inf
    jitter: float = 0.0

    def __call__(self, failures: int) -> float:
        try:
            grown = self.first_s * self.factor ** max(0, failures - 1)
        except OverflowError:  # failing for a very long time: the ceiling holds
            grown = math.inf
        pause = min(self.max_s, grown)
        return pause * (1 + self.jitter * random.random()) if self.jitter else pause


def retry(
    call: Callable[[], T],
    *,
    on: type[Exception] | tuple[type[Exception], ...],
    attempts: int,
    pause: Pause,
    when: Callable[[Exception], bool] = lambda exc: True,
) -> T:
    """`call()`, called again after `pause(n)` seconds when its n-th failure in a row is
    an instance of `on` that `when` accepts, at most `attempts` calls in all; the last
    failure, or one not retried, is raised as it was."""
    failures = 0
    while True:
        try:
            return call()
        except on as exc:
            failures += 1
            if failures >= attempts or not when(exc):
                raise
        time.sleep(pause(failures))


class RetryGate:
    """Whether a loop that must not block may try again now: after the n-th failure
    in a row, not before `pause(n)` seconds have passed since that try."""

    def __init__(self, pause: Pause) -> None:
        self.pause = pause
        self.failures = 0  # in a row
        self.failing_since: float | None = None  # when the first of them was learnt
        self._next_try = -math.inf

    def ready(self, now: float) -> bool:
        return now >= self._next_try

    def failed(self, now: float, tried_at: float | None = None) -> float:
        """Counts a failure learnt at `now` of the try made at `tried_at` (default: now);
        returns the pause before the next try, counted from `tried_at`."""
        self.failures += 1
        if self.failing_since is None:
            self.failing_since = now
        pause = self.pause(self.failures)
        self._next_try = (now if tried_at is None else tried_at) + pause
        return pause

    def succeeded(self) -> None:
        self.failures = 0
        self.failing_since = None
        self._next_try = -math.inf
