"""What one apply of the current view changes (sinks.view), decided from the segment
rows read past the view's positions and the live versions of the documents they
name. Pure: no table is read or written here.

The latest version of a document: the highest offset within a partition; across
partitions (producers that do not key by document), the later record timestamp,
then the larger topic, then the larger partition (`newer`). A tombstone is a version
too: a document is live when its latest version, over every version applied so far,
is not a tombstone. So that holds whatever the order in which partitions reach the
view, each document's latest tombstone is remembered (sinks.view_keys), and a
version not newer than it stays deleted: without it, a tombstone that deleted a key
left no trace, and an older version from another partition applied later came back.
Every version that is not the latest stops being served by the index
(`Plan.removed`).

A version is a record: in a chunked output (`pipeline run --chunk-tokens N`) the
rows of one (topic, partition, offset), one per chunk. A winning version brings
all its rows; a replaced one takes all its live rows with it, whatever the number
of chunks of either.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pipeline.core.chunks import CHUNK, CHUNK_COUNT
from pipeline.core.documents import DELETED, DOC_KEY

ORDER = ["topic", "partition", "offset", "timestamp"]
Place = tuple[str, int, int]  # topic, partition, offset
# A live version's rows in a chunked view (Live: its chunk numbers).
CHUNKS = "chunks"


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
    upserts: pa.Table  # the rows to insert (every chunk row of each winning version)
    gone: list[str] = field(default_factory=list)  # documents deleted
    removed: list[Place] = field(default_factory=list)  # versions the index stops serving
    # Chunked outputs: in step with `removed`, each version's chunk count (None: plain).
    removed_counts: list[int] | None = None
    # The live rows that go (one per chunk row of a replaced chunked version).
    replaced: list[Mapping[str, Any]] = field(default_factory=list)
    # Keys first seen in 2+ partitions by this apply (not among those already `flagged`).
    cross_partition: list[str] = field(default_factory=list)
    # The documents' new latest tombstones (their ORDER columns), to remember.
    tombstones: dict[str, dict[str, Any]] = field(default_factory=dict)
    documents: int = 0  # documents given a new version

    def remove(self, version: Mapping[str, Any], chunk_count: int | None) -> None:
        self.removed.append(_place(version))
        if self.removed_counts is not None:
            self.removed_counts.append(max(1, int(chunk_count or 1)))

    def take_down(self, current: Mapping[str, Any]) -> None:
        """A live version stops being live."""
        self.remove(current, current.get(CHUNK_COUNT))
        self.replaced += _live_rows(current)

    def supersede(
        self, key: str, change: Mapping[str, Any], current: Mapping[str, Any] | None
    ) -> bool:
        """`change` is the document's latest version; whether it is live."""
        if current is not None:
            self.take_down(current)
        if not change[DELETED]:
            self.documents += 1
            return True
        self.tombstones[key] = {c: change[c] for c in ORDER}
        if current is not None:
            self.gone.append(key)
        return False

    def lose(
        self,
        key: str,
        change: Mapping[str, Any],
        current: Mapping[str, Any] | None,
        tombstone: Mapping[str, Any] | None,
    ) -> None:
        """`change` is older than the live version, or than the document's tombstone
        (the document stays deleted, whatever the order partitions were applied in)."""
        if not change[DELETED]:
            self.remove(change, change.get(CHUNK_COUNT))
        if current is not None and tombstone is not None and newer(tombstone, current):
            # A tombstone the view itself never applied: one kept for a view rebuilt
            # beside its key table (sinks.view_keys.KeyMemory.settle).
            self.take_down(current)
            self.gone.append(key)


def plan(
    rows: pa.Table,
    live: Mapping[str, Mapping[str, Any]],
    dead: Mapping[str, Mapping[str, Any]] | None = None,
    flagged: Collection[str] = (),
) -> Plan:
    """The apply of segment `rows` (with DOC_KEY, DELETED and ORDER columns; CHUNK and
    CHUNK_COUNT in a chunked output, every row of a record among them) onto the
    documents whose live versions are `live` (by key: their ORDER columns; chunked,
    their CHUNK_COUNT and CHUNKS, the chunk numbers of their live rows), whose latest
    tombstones are `dead` (by key: their ORDER columns), and of which those in
    `flagged` were seen in more than one partition already."""
    dead = dead or {}
    chunked = CHUNK in rows.column_names
    names = [DOC_KEY, DELETED, *ORDER, *([CHUNK_COUNT] if chunked else [])]
    table = rows.select(names).to_pylist()
    records: dict[Place, list[int]] = {}  # a record's rows, by place
    for index, row in enumerate(table):
        records.setdefault(_place(row), []).append(index)
    versions = [table[indices[0]] for indices in records.values()]
    latest: dict[str, int] = {}
    partitions: dict[str, set[tuple[str, int]]] = {}
    for index, row in enumerate(versions):
        key = row[DOC_KEY]
        partitions.setdefault(key, set()).add((row["topic"], row["partition"]))
        held = latest.get(key)
        if held is None or newer(row, versions[held]):
            latest[key] = index
    result = Plan(rows.slice(0, 0), removed_counts=[] if chunked else None)
    winners: list[int] = []
    chosen = set(latest.values())
    for index, row in enumerate(versions):
        if index not in chosen and not row[DELETED]:
            result.remove(row, row.get(CHUNK_COUNT))
    for key, index in latest.items():
        change, current, tombstone = versions[index], live.get(key), dead.get(key)
        for known in (current, tombstone):
            if known is not None:
                partitions[key].add((known["topic"], known["partition"]))
        if not all(known is None or newer(change, known) for known in (current, tombstone)):
            result.lose(key, change, current, tombstone)
        elif result.supersede(key, change, current):
            winners += records[_place(change)]
    result.upserts = rows.take(pa.array(sorted(winners), pa.int64()))
    result.cross_partition = [
        k for k, seen in partitions.items() if len(seen) > 1 and k not in flagged
    ]
    return result


def _live_rows(current: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The view's rows of a live version: one, or one per chunk row it holds."""
    if CHUNKS not in current:
        return [current]
    return [{**current, CHUNK: chunk} for chunk in current[CHUNKS]]
