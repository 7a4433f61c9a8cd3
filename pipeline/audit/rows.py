"""The output's rows: every record's offset per partition, read from the segments.

A chunked output (`pipeline run --chunk-tokens N`) has a row per chunk of a record:
there a record counts once per segment it is in (the accounting finds an offset in
two segments doubled), and its chunks are checked to be complete
(pipeline.audit.chunks).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.audit.chunks import ChunkProblem, chunk_problems
from pipeline.audit.coverage import Coverage, DamagedFile, check_coverage
from pipeline.audit.ranges import EMPTY, Key
from pipeline.core.chunks import CHUNK, CHUNK_COUNT
from pipeline.core.layout import segments_by_partition
from sinks.segments import DamagedSegment, SegmentInfo, read_rows
from sinks.vectors_swap import read_consistently


@dataclass
class OutputRows:
    """Every record's offset per partition (sorted, repeats kept: one per segment
    holding rows of it) and what the footers say."""

    offsets: dict[Key, np.ndarray] = field(default_factory=dict)
    # Offsets a purge erased (upsert mode: sinks.purge), from the footers: accounted for.
    purged: dict[Key, np.ndarray] = field(default_factory=dict)
    infos: dict[Key, list[SegmentInfo]] = field(default_factory=dict)
    damaged: dict[Key, list[DamagedFile]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # Chunked outputs: the partitions with chunk rows, their row counts, and the
    # offsets whose chunks are not complete (with the first few described).
    chunk_rows: dict[Key, int] = field(default_factory=dict)
    bad_chunks: dict[Key, np.ndarray] = field(default_factory=dict)
    chunk_problems: dict[Key, list[ChunkProblem]] = field(default_factory=dict)

    def rows_of(self, key: Key) -> np.ndarray:
        return self.offsets.get(key, EMPTY)

    def purged_of(self, key: Key) -> np.ndarray:
        return self.purged.get(key, EMPTY)

    def chunked(self, key: Key) -> bool:
        return key in self.chunk_rows

    def bad_chunks_of(self, key: Key) -> np.ndarray:
        return self.bad_chunks.get(key, EMPTY)

    def coverage(self, key: Key, committed: int | None) -> Coverage:
        return check_coverage(key, self.infos.get(key, []), self.damaged.get(key, []), committed)


def read_output_rows(output: Path, topics: Iterable[str]) -> OutputRows:
    """Reads the topic, partition and offset (and chunk, chunk_count where the segments
    have them) of every row of the topics' segments."""
    # Read again if a compaction exchanged the files meanwhile (sinks.vectors_swap).
    return read_consistently(output, lambda: _read_output_rows(output, topics))


def _read_output_rows(output: Path, topics: Iterable[str]) -> OutputRows:
    found = OutputRows()
    parts: dict[Key, list[np.ndarray]] = defaultdict(list)
    purged: dict[Key, list[np.ndarray]] = defaultdict(list)
    bad: dict[Key, list[np.ndarray]] = defaultdict(list)
    for key, segments in segments_by_partition(output, topics).items():
        for segment in segments:
            try:
                table, info = read_rows(
                    segment, ["topic", "partition", "offset"], optional=[CHUNK, CHUNK_COUNT]
                )
            except FileNotFoundError:
                found.warnings.append(f"{segment.where} vanished while reading (quarantined?)")
                continue
            except DamagedSegment as exc:
                found.damaged.setdefault(key, []).append(DamagedFile.of(exc))
                continue
            found.infos.setdefault(key, []).append(info)
            purged[key] += [
                np.arange(first, last + 1, dtype=np.int64) for first, last in info.purged
            ]
            offsets = table.column("offset").to_numpy().astype(np.int64)
            chunked = CHUNK in table.column_names
            chunks = _ints(table, CHUNK) if chunked else None
            counts = _ints(table, CHUNK_COUNT) if chunked else None
            for row_key, rows in _rows_by_partition(table, key):
                if row_key != key:
                    found.warnings.append(
                        f"{segment.where} holds rows of {row_key[0]}[{row_key[1]}]"
                    )
                if chunks is None or counts is None:
                    parts[row_key].append(offsets[rows])
                    continue
                # A record counts once in this segment; its chunks are checked here,
                # where all of them must be.
                found.chunk_rows[row_key] = found.chunk_rows.get(row_key, 0) + len(offsets[rows])
                parts[row_key].append(np.unique(offsets[rows]))
                wrong, described = chunk_problems(offsets[rows], chunks[rows], counts[rows])
                if wrong.size:
                    bad[row_key].append(wrong)
                    found.chunk_problems.setdefault(row_key, []).extend(described)
    for key, found_parts in parts.items():
        found.offsets[key] = np.sort(np.concatenate(found_parts))
    for key, erased in purged.items():
        if erased:
            found.purged[key] = np.sort(np.concatenate(erased))
    for key, wrong_parts in bad.items():
        found.bad_chunks[key] = np.unique(np.concatenate(wrong_parts))
    return found


def _ints(table: pa.Table, name: str) -> np.ndarray:
    """A chunk column as int64 (nulls as -1); all -1 where the segment lacks it."""
    if name not in table.column_names:
        return np.full(table.num_rows, -1, dtype=np.int64)
    return pc.fill_null(table.column(name), -1).to_numpy().astype(np.int64)


def _rows_by_partition(table: pa.Table, key: Key) -> Iterator[tuple[Key, slice | np.ndarray]]:
    """Which of a segment's rows are of which (topic, partition) (column values)."""
    topics = pc.unique(table.column("topic")).to_pylist()
    partitions = pc.unique(table.column("partition")).to_pylist()
    if table.num_rows == 0 or (topics == [key[0]] and partitions == [key[1]]):
        yield key, slice(None)  # the usual case: every row is of the segment's partition
        return
    topic_values = table.column("topic").to_numpy(zero_copy_only=False)
    partition_values = table.column("partition").to_numpy()
    for topic in topics:
        for partition in partitions:
            mask = (topic_values == topic) & (partition_values == partition)
            if mask.any():
                yield (topic, int(partition)), mask
