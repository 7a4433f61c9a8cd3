"""Priority tiers in the status report (`pipeline run --backfill-topic`, consumers.tiers).

A tiered worker names each partition's tier in the metadata of its committed
offsets; every row gets `tier` ("nearline", "backfill", or null when no tiered
worker committed the topic) and `waiting`.

Backfill waits by design while nearline lag is worked off, so a backfill
partition whose commits stand still then is not STALLED: it is LAGGING, with
`waiting: "nearline"`, as long as some nearline partition has lag and its commits
move. When nothing moves, STALLED stays STALLED.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from pipeline.status.verdicts import LAGGING, STALLED

NEARLINE = "nearline"
BACKFILL = "backfill"


def apply_tiers(
    rows: Sequence[MutableMapping[str, Any]], tiers: Mapping[tuple[str, int], str]
) -> None:
    """Adds `tier` and `waiting` to each row (in place) and softens the verdicts of
    backfill partitions that wait for nearline."""
    # A topic has one tier; a partition not yet committed by a tiered worker takes
    # its topic's.
    by_topic: dict[str, str] = {}
    for (topic, _), tier in sorted(tiers.items()):
        by_topic.setdefault(topic, tier)
    for row in rows:
        row["tier"] = tiers.get((row["topic"], row["partition"]), by_topic.get(row["topic"]))
        row["waiting"] = None
    nearline = [row for row in rows if row["tier"] == NEARLINE]
    nearline_busy = any(row["lag"] > 0 for row in nearline) and any(
        (row.get("throughput") or 0) > 0 for row in nearline
    )
    if not nearline_busy:
        return
    for row in rows:
        if row["tier"] == BACKFILL and row.get("lag_verdict") == STALLED:
            row["waiting"] = NEARLINE
            row["lag_verdict"] = LAGGING
            if row.get("verdict") == STALLED:  # MISMATCH trumps, as ever
                row["verdict"] = LAGGING
