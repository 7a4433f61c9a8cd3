"""Verdicts, exit codes, rates and ETA: pure functions over samples, no I/O.

Verdicts, in the spirit of Burrow, are judged per partition over a short
history of samples and for the group as the worst of its partitions:

    verdict   exit code  meaning
    OK        0          no lag, or the lag is shrinking (the group catches up)
    LAGGING   1          lag > 0 and not shrinking: commits move no faster than
                         the end (also the verdict for lag > 0 with one sample)
    STALLED   2          lag > 0, members present, but the committed offset did
                         not move across the whole history window (at least
                         `stall_after_seconds` long)
    STOPPED   3          lag > 0 and nobody consumes it: the group has no members
                         (Empty/Dead), or it is Stable and no member owns the
                         partition
    MISMATCH  4          (with --output) the output's segments do not account
                         for every committed offset, or two of them overlap

Operational errors (broker down, bad configuration) never use 0-4: see
`pipeline.core.errors`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

OK = "OK"
LAGGING = "LAGGING"
STALLED = "STALLED"
STOPPED = "STOPPED"
MISMATCH = "MISMATCH"
VERDICTS = (OK, LAGGING, STALLED, STOPPED, MISMATCH)  # in order of severity
_EXIT_CODES = {verdict: code for code, verdict in enumerate(VERDICTS)}
# Group states in which nobody consumes, whatever the lag (KIP-518 names).
IDLE_STATES = frozenset({"Empty", "Dead"})


@dataclass(frozen=True)
class Point:
    """One partition as seen at one refresh."""

    time: float
    committed: int | None
    end: int

    @property
    def lag(self) -> int:
        return partition_lag(self.committed, self.end)


def partition_lag(committed: int | None, end: int) -> int:
    """End minus committed; the whole partition when nothing is committed."""
    if committed is None:
        return end
    # A committed offset past the end (topic recreated, records truncated) is
    # not negative work; clamp so that total_lag stays meaningful.
    return max(0, end - committed)


def judge_partition(
    points: Sequence[Point], *, consumed: bool, stall_after_seconds: float = 30.0
) -> str:
    """The lag verdict for one partition from its samples, oldest first.

    `consumed` says whether anybody could be consuming it (the group has members
    and, when the assignment is known, one of them owns the partition).
    """
    if not points:
        raise ValueError("judge_partition needs at least one sample")
    last = points[-1]
    if last.lag == 0:
        return OK
    if not consumed:
        return STOPPED
    first = _first_committed(points)
    if first is None or first is last:
        # One sample (or nothing committed yet): we only know there is lag.
        return LAGGING
    if first.committed == last.committed:
        # Commits did not move. Only call it a stall once the window is long
        # enough: a worker busy on one large batch commits seconds apart.
        span = last.time - first.time
        return STALLED if span >= stall_after_seconds else LAGGING
    if last.lag < first.lag:
        return OK  # commits outrun the end: the group is catching up
    return LAGGING


def worst(verdicts: Iterable[str]) -> str:
    """The most severe verdict; OK for none."""
    return max(verdicts, key=VERDICTS.index, default=OK)


def exit_code_for(verdict: str) -> int:
    """OK 0, LAGGING 1, STALLED 2, STOPPED 3, MISMATCH 4."""
    try:
        return _EXIT_CODES[verdict]
    except KeyError:
        raise ValueError(f"unknown verdict {verdict!r}; expected one of {VERDICTS}") from None


def commit_rate(points: Sequence[Point]) -> float | None:
    """Records per second committed over the samples; None without two timed commits."""
    first = _first_committed(points)
    last = points[-1] if points else None
    if first is None or last is None or last.committed is None:
        return None
    span = last.time - first.time
    if span <= 0:
        return None
    return max(0.0, (last.committed - first.committed) / span)


def end_rate(points: Sequence[Point]) -> float | None:
    """Records per second appended to the partition over the samples."""
    if len(points) < 2 or points[-1].time <= points[0].time:
        return None
    return max(0.0, (points[-1].end - points[0].end) / (points[-1].time - points[0].time))


def drain_eta(lag: int, consumed_per_s: float | None, produced_per_s: float | None) -> float | None:
    """Seconds until the lag is gone at the current rates; None when it never drains."""
    if lag == 0:
        return 0.0
    if consumed_per_s is None:
        return None
    # Net rate: what the group commits minus what producers keep appending.
    net = consumed_per_s - (produced_per_s or 0.0)
    return lag / net if net > 0 else None


def _first_committed(points: Sequence[Point]) -> Point | None:
    # A partition may gain its first commit inside the window; rates and stall
    # detection start from the first sample that has one.
    return next((p for p in points if p.committed is not None), None)
