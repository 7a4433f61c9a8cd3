"""Segment coverage, from the footers alone.

Do the segments of a partition tile its offsets from the first segment up to
the committed offset, with no gap and no overlap? `pipeline status --output`
uses this check (`output_coverage`) and `pipeline audit` reports it: one
implementation for both commands.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.audit.ranges import Key, Range, complement, describe_ranges, merge
from pipeline.core.layout import SegmentFile, segments_by_partition
from sinks.segments import DamagedSegment, SegmentInfo, read_info
from sinks.vectors_swap import read_consistently


@dataclass(frozen=True)
class DamagedFile:
    """A segment whose footer or rows cannot be read; its offsets count as a gap."""

    path: str
    topic: str
    partition: int
    first: int
    reason: str

    @classmethod
    def of(cls, damaged: DamagedSegment) -> DamagedFile:
        key = damaged.segment.key
        return cls(damaged.segment.where, key.topic, key.partition, key.first, damaged.reason)

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.path, "first": self.first, "reason": self.reason}


@dataclass(frozen=True)
class Coverage:
    """What a partition's segments claim to cover, against the group's committed offset.

    `gaps`: offsets from the first segment's first offset (0 when there is no
    segment at all) up to committed-1 that no readable segment covers.
    `overlaps`: offsets that two segments cover. `rows` counts rows, one vector each
    (the index's entries): in a chunked output (`chunked`) a row per chunk, not per
    record.
    """

    topic: str
    partition: int
    committed: int | None
    files: int
    rows: int
    first: int | None
    covered_through: int | None
    start: str | None
    gaps: tuple[Range, ...] = ()
    overlaps: tuple[Range, ...] = ()
    damaged: tuple[DamagedFile, ...] = ()
    chunked: bool = False  # a segment's rows are chunks of records (sinks.segments)

    @property
    def ok(self) -> bool:
        return not self.gaps and not self.overlaps

    def problems(self) -> list[str]:
        """One phrase per problem, for the status table's MISMATCH column."""
        found = []
        if self.gaps and self.first is None:
            found.append(f"committed {self.committed} but no segments")
        elif self.gaps:
            through = "-" if self.covered_through is None else self.covered_through
            found.append(
                f"offsets {describe_ranges(self.gaps, 3)} below committed {self.committed} "
                f"in no segment (files cover through {through})"
            )
        if self.overlaps:
            found.append(f"offsets {describe_ranges(self.overlaps, 3)} in two segments")
        if self.damaged:
            found.append(f"{len(self.damaged)} damaged file(s)")
        return found


def check_coverage(
    key: Key,
    readable: Sequence[SegmentInfo],
    damaged: Sequence[DamagedFile],
    committed: int | None,
) -> Coverage:
    """Checks that the segments tile the partition from its first segment to committed-1."""
    ranges = sorted((info.first, info.last) for info in readable)
    first = min([f for f, _ in ranges] + [d.first for d in damaged], default=None)
    start = next((i.start for i in readable if i.first == first), None)
    # A damaged segment's offsets are in no readable segment: they fall into a gap.
    gaps = complement(first or 0, committed, ranges) if committed is not None else []
    return Coverage(
        topic=key[0],
        partition=key[1],
        committed=committed,
        files=len(readable) + len(damaged),
        rows=sum(info.rows for info in readable),
        first=first,
        covered_through=max((last for _, last in ranges), default=None),
        start=start,
        gaps=tuple(gaps),
        overlaps=tuple(_overlaps(ranges)),
        damaged=tuple(damaged),
        chunked=any(info.chunked for info in readable),
    )


def _overlaps(ranges: Sequence[Range]) -> list[Range]:
    # Sorted by first offset, everything before a range that reaches into it
    # covers it from its first offset on: the overlap is one piece per range.
    found = []
    reach: int | None = None
    for first, last in ranges:
        if reach is not None and first <= reach:
            found.append((first, min(last, reach)))
        reach = last if reach is None else max(reach, last)
    return merge(found)


def read_footers(segments: Sequence[SegmentFile]) -> tuple[list[SegmentInfo], list[DamagedFile]]:
    """The footers of the segments; damaged ones apart, vanished ones (quarantined) left out."""
    readable, damaged = [], []
    for segment in segments:
        try:
            readable.append(read_info(segment))
        except FileNotFoundError:
            continue  # a worker moved it aside meanwhile
        except DamagedSegment as exc:
            damaged.append(DamagedFile.of(exc))
    return readable, damaged


def output_coverage(
    output: Path, committed: Mapping[Key, int], topics: Iterable[str] | None = None
) -> dict[Key, Coverage]:
    """Coverage of every partition that has segments or a committed offset (footers only)."""
    wanted = set(topics) if topics is not None else None
    # Read again if a compaction exchanged the files meanwhile (sinks.vectors_swap).
    return read_consistently(output, lambda: _output_coverage(output, committed, wanted))


def _output_coverage(
    output: Path, committed: Mapping[Key, int], wanted: set[str] | None
) -> dict[Key, Coverage]:
    segments = segments_by_partition(output, wanted)
    keys = set(segments) | {k for k in committed if wanted is None or k[0] in wanted}
    coverage = {}
    for key in sorted(keys):
        readable, damaged = read_footers(segments.get(key, []))
        coverage[key] = check_coverage(key, readable, damaged, committed.get(key))
    return coverage
