"""A worker's log read from outside: which partitions it owned, and when.

The worker writes one line per rebalance (consumers.partitions.RebalanceLog):

    2026-12-03 05:00:00,123 INFO consumers.partitions: partitions rebalanced in 1.2s:
        assigned t[2]@1500; revoked t[1]; kept t[0]

("joined the group" for its first), "partitions lost: [('t', 0)]" when the group moved
on without it, and "partitions revoked at close: t[0] t[1]" as it stops.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

# One of the three kinds of ownership line, with its time stamp.
OWNERSHIP = re.compile(
    r"^(?P<at>\S+ \S+) \S+ consumers\.partitions: partitions (?:"
    r"(?:joined the group|rebalanced)(?: in [\d.]+s)?: "
    r"assigned (?P<assigned>.*?); revoked (?P<revoked>.*?); kept .*"
    r"|lost: (?P<lost>\[.*\])"
    r"|revoked at close: (?P<closed>.*))$",
    re.MULTILINE,
)
# A partition as the rebalance lines write it: topic[partition], maybe @start.
PARTITION = re.compile(r"([A-Za-z0-9._-]+)\[(\d+)\]")
# A partition as a Python list of tuples writes it: ('topic', partition).
LISTED_PARTITION = re.compile(r"\('([^']+)', (\d+)\)")

Key = tuple[str, int]


@dataclass(frozen=True)
class OwnershipChange:
    kind: str  # "rebalance", "lost" or "closed"
    at: str  # the line's time stamp, as logged
    position: int  # where the line starts in the log (orders changes of several formats)
    gone: frozenset[Key]
    came: frozenset[Key]


def _keys(pattern: re.Pattern[str], text: str | None) -> frozenset[Key]:
    return frozenset((topic, int(p)) for topic, p in pattern.findall(text or ""))


def ownership_changes(log: str) -> list[OwnershipChange]:
    """Every ownership line of a worker's log, in order."""
    changes = []
    for line in OWNERSHIP.finditer(log):
        if line["lost"] is not None:
            kind, gone, came = "lost", _keys(LISTED_PARTITION, line["lost"]), frozenset()
        elif line["closed"] is not None:
            kind, gone, came = "closed", _keys(PARTITION, line["closed"]), frozenset()
        else:
            kind = "rebalance"
            gone, came = _keys(PARTITION, line["revoked"]), _keys(PARTITION, line["assigned"])
        changes.append(OwnershipChange(kind, line["at"], line.start(), gone, came))
    return changes


def owned(log: str) -> set[Key]:
    """The partitions a worker owns after the last line of its log."""
    now: set[Key] = set()
    for change in ownership_changes(log):
        now = (now - change.gone) | change.came
    return now


def stamp(at: str) -> float:
    """A log line's time stamp (logging's default asctime) as a Unix time."""
    return datetime.strptime(at, "%Y-%m-%d %H:%M:%S,%f").timestamp()
