"""What one apply of the current view changes (sinks.view), decided from the segment
rows read past the view's positions and the live versions of the documents they
name. Pure: no table is read or written here.

The latest version of a document: the highest offset within a partition; across
partitions (producers that do not key by document), the later record timestamp,
then the larger topic, then the larger partition (`newer`). Every version that is
not the latest stops being served by the index (`Plan.removed`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pipeline.core.documents import DELETED, DOC_KEY

ORDER = ["topic", "partition", "offset", "timestamp"]
Place = tuple[str, int, int]  # topic, partition, offset


def newer(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether version `a` of a document supersedes version `b`."""
    if (a["topic"], a["partition"]) == (b["topic"], b["partition"]):
        return a["offset"] > b["offset"]
    return (a["timestamp"], a["topic"], a["partition"]) > (
        b["timestamp"],
        b["topic"],
        b["partition"],
    )


def _place(row: Mapping[str, Any]) -> Place:
    return row["topic"], row["partition"], row["offset"]


@dataclass
class Plan:
    upserts: pa.Table  # the rows to insert or to replace live ones with
    gone: list[str] = field(default_factory=list)  # documents deleted
    removed: list[Place] = field(default_factory=list)  # versions the index stops serving
    replaced: list[Mapping[str, Any]] = field(default_factory=list)  # live rows that go
    cross_partition: list[str] = field(default_factory=list)  # keys seen in 2+ partitions


def plan(rows: pa.Table, live: Mapping[str, Mapping[str, Any]]) -> Plan:
    """The apply of segment `rows` (with DOC_KEY, DELETED and ORDER columns) onto the
    documents whose live versions are `live` (by key: their ORDER columns)."""
    versions = rows.select([DOC_KEY, DELETED, *ORDER]).to_pylist()
    latest: dict[str, int] = {}
    partitions: dict[str, set[tuple[str, int]]] = {}
    for index, row in enumerate(versions):
        key = row[DOC_KEY]
        partitions.setdefault(key, set()).add((row["topic"], row["partition"]))
        held = latest.get(key)
        if held is None or newer(row, versions[held]):
            latest[key] = index
    result = Plan(rows.slice(0, 0))
    winners: list[int] = []
    chosen = set(latest.values())
    result.removed = [
        _place(row) for i, row in enumerate(versions) if i not in chosen and not row[DELETED]
    ]
    for key, index in latest.items():
        change, current = versions[index], live.get(key)
        if current is not None:
            partitions[key].add((current["topic"], current["partition"]))
        if current is not None and not newer(change, current):
            if not change[DELETED]:  # an older version from another partition: never live
                result.removed.append(_place(change))
            continue
        if current is not None:
            result.removed.append(_place(current))
            result.replaced.append(current)
        if change[DELETED]:
            if current is not None:
                result.gone.append(key)
        else:
            winners.append(index)
    result.upserts = rows.take(pa.array(sorted(winners), pa.int64()))
    result.cross_partition = [k for k, seen in partitions.items() if len(seen) > 1]
    return result
