"""The accounting of one partition: rows ∪ dead letters against the committed offset.

Pure: the gaps are read from Kafka through a `Scan` (`kafka_reads.kafka_scan`
in the audit, a fake in the tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.audit.chunks import ChunkProblem
from pipeline.audit.coverage import Coverage
from pipeline.audit.ranges import (
    EMPTY,
    Key,
    Range,
    clip,
    complement,
    count,
    merge,
    repeated,
    runs,
    within,
)
from sinks.segments import START_FROM_COMMITTED

# (found offsets in the ranges, the partition's log-start offset after reading)
Scan = Callable[[Key, Sequence[Range]], tuple[np.ndarray, int]]


@dataclass
class PartitionAudit:
    topic: str
    partition: int
    committed: int | None
    log_start: int
    end: int
    checked_from: int
    rows: int
    dead_lettered: int
    purged: int  # offsets whose rows a purge erased (upsert mode), accounted for
    missing: list[Range]
    doubled: list[Range]
    dead_letter_repeats: list[Range]
    unverifiable: int
    without_record: int
    scanned: int
    coverage: Coverage
    # Chunked outputs: `rows` counts records (an offset once per segment holding it);
    # `chunk_rows` the rows, and `bad_chunks` the records whose chunks are not
    # complete (pipeline.audit.chunks), the first few of them described.
    chunked: bool = False
    chunk_rows: int = 0
    bad_chunks: list[Range] = field(default_factory=list)
    chunk_problems: list[ChunkProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            not self.missing
            and not self.doubled
            and not self.dead_letter_repeats
            and not self.bad_chunks
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "committed": self.committed,
            "log_start": self.log_start,
            "end": self.end,
            "checked_from": self.checked_from,
            "rows": self.rows,
            "dead_lettered": self.dead_lettered,
            "purged": self.purged,
            "missing": [list(r) for r in self.missing],
            "missing_count": count(self.missing),
            "doubled": [list(r) for r in self.doubled],
            "doubled_count": count(self.doubled),
            "dead_letter_repeats": [list(r) for r in self.dead_letter_repeats],
            "unverifiable": self.unverifiable,
            "without_record": self.without_record,
            "scanned": self.scanned,
            "segments": {
                "files": self.coverage.files,
                "first": self.coverage.first,
                "covered_through": self.coverage.covered_through,
                "start": self.coverage.start,
                "gaps": [list(r) for r in self.coverage.gaps],
                "overlaps": [list(r) for r in self.coverage.overlaps],
                "damaged": [d.to_dict() for d in self.coverage.damaged],
            },
            **(self._chunk_fields() if self.chunked else {}),
            "ok": self.ok,
        }

    def _chunk_fields(self) -> dict[str, Any]:
        return {
            "chunked": True,
            "chunk_rows": self.chunk_rows,
            "bad_chunks": [list(r) for r in self.bad_chunks],
            "bad_chunks_count": count(self.bad_chunks),
            "chunk_problems": [
                {"offset": p.offset, "problem": p.problem} for p in self.chunk_problems
            ],
        }


def audit_partition(
    key: Key,
    committed: int | None,
    log_start: int,
    end: int,
    rows: np.ndarray,
    dead_letters: np.ndarray,
    coverage: Coverage,
    scan: Scan,
    purged: np.ndarray = EMPTY,
    chunk_rows: int | None = None,
    bad_chunks: np.ndarray = EMPTY,
    chunk_problems: Sequence[ChunkProblem] = (),
) -> PartitionAudit:
    """Accounts for the partition's offsets below `committed`; `scan` reads the gaps in Kafka.

    `rows` and `dead_letters` are sorted offsets, repeats kept; `end` is the
    read_committed end (last stable offset) and `log_start` the first offset
    Kafka still holds. A chunked output (`chunk_rows` given: its row count) gives
    one offset in `rows` per record and segment, and in `bad_chunks` the offsets
    whose chunks are not complete, `chunk_problems` describing the first of them.
    """
    first = coverage.first
    checked_from = first if coverage.start == START_FROM_COMMITTED and first is not None else 0
    # An erased row's offset counts as its row did: once, and never beside another.
    rows = np.sort(np.concatenate([rows, purged])) if len(purged) else rows
    distinct_rows = np.unique(rows)
    distinct_dead = np.unique(dead_letters)
    accounted = np.union1d(distinct_rows, distinct_dead)
    doubled = merge(runs(repeated(rows)) + runs(np.intersect1d(distinct_rows, distinct_dead)))

    limit = checked_from if committed is None else max(committed, checked_from)
    inside = accounted[(accounted >= checked_from) & (accounted < limit)]
    gaps = complement(checked_from, limit, runs(inside))
    # Offsets past the last stable offset cannot be read yet (an open transaction,
    # or a commit past a truncated log): they are not verifiable now.
    readable = clip(gaps, log_start, end)
    found, start_after = scan(key, readable) if readable else (EMPTY, log_start)
    found = np.unique(found[within(found, readable)])
    # Retention may have moved the log start while we read: what it deleted before
    # we saw it is unverifiable, not "no record".
    lost = clip(readable, 0, max(log_start, start_after))
    unseen_lost = count(lost) - int(within(found, lost).sum())
    unverifiable = count(gaps) - count(readable) + unseen_lost
    return PartitionAudit(
        topic=key[0],
        partition=key[1],
        committed=committed,
        log_start=log_start,
        end=end,
        checked_from=checked_from,
        rows=int(rows.size - purged.size),
        dead_lettered=int(distinct_dead.size),
        purged=int(purged.size),
        missing=runs(found),
        doubled=doubled,
        dead_letter_repeats=runs(repeated(dead_letters)),
        unverifiable=unverifiable,
        without_record=count(readable) - unseen_lost - int(found.size),
        scanned=count(readable),
        coverage=coverage,
        chunked=chunk_rows is not None,
        chunk_rows=chunk_rows or 0,
        bad_chunks=runs(bad_chunks),
        chunk_problems=list(chunk_problems),
    )
