"""The output's rows: every row's offset per partition, read from the segments."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.audit.coverage import Coverage, DamagedFile, check_coverage
from pipeline.audit.ranges import EMPTY, Key
from pipeline.core.layout import segments_by_partition
from sinks.segments import DamagedSegment, SegmentInfo, read_rows
from sinks.vectors_swap import read_consistently


@dataclass
class OutputRows:
    """Every row's offset per partition (sorted, repeats kept) and what the footers say."""

    offsets: dict[Key, np.ndarray] = field(default_factory=dict)
    # Offsets a purge erased (upsert mode: sinks.purge), from the footers: accounted for.
    purged: dict[Key, np.ndarray] = field(default_factory=dict)
    infos: dict[Key, list[SegmentInfo]] = field(default_factory=dict)
    damaged: dict[Key, list[DamagedFile]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def rows_of(self, key: Key) -> np.ndarray:
        return self.offsets.get(key, EMPTY)

    def purged_of(self, key: Key) -> np.ndarray:
        return self.purged.get(key, EMPTY)

    def coverage(self, key: Key, committed: int | None) -> Coverage:
        return check_coverage(key, self.infos.get(key, []), self.damaged.get(key, []), committed)


def read_output_rows(output: Path, topics: Iterable[str]) -> OutputRows:
    """Reads the topic, partition and offset of every row of the topics' segments."""
    # Read again if a compaction exchanged the files meanwhile (sinks.vectors_swap).
    return read_consistently(output, lambda: _read_output_rows(output, topics))


def _read_output_rows(output: Path, topics: Iterable[str]) -> OutputRows:
    found = OutputRows()
    chunks: dict[Key, list[np.ndarray]] = defaultdict(list)
    purged: dict[Key, list[np.ndarray]] = defaultdict(list)
    for key, segments in segments_by_partition(output, topics).items():
        for segment in segments:
            try:
                table, info = read_rows(segment, ["topic", "partition", "offset"])
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
            for row_key, offsets in _offsets_by_partition(table, key):
                if row_key != key:
                    found.warnings.append(
                        f"{segment.where} holds rows of {row_key[0]}[{row_key[1]}]"
                    )
                chunks[row_key].append(offsets)
    for key, parts in chunks.items():
        found.offsets[key] = np.sort(np.concatenate(parts))
    for key, parts in purged.items():
        if parts:
            found.purged[key] = np.sort(np.concatenate(parts))
    return found


def _offsets_by_partition(table: pa.Table, key: Key) -> Iterator[tuple[Key, np.ndarray]]:
    """The offsets of a segment's rows per (topic, partition) column values."""
    offsets = table.column("offset").to_numpy().astype(np.int64)
    topics = pc.unique(table.column("topic")).to_pylist()
    partitions = pc.unique(table.column("partition")).to_pylist()
    if table.num_rows == 0 or (topics == [key[0]] and partitions == [key[1]]):
        yield key, offsets  # the usual case: every row is of the segment's partition
        return
    topic_values = table.column("topic").to_numpy(zero_copy_only=False)
    partition_values = table.column("partition").to_numpy()
    for topic in topics:
        for partition in partitions:
            mask = (topic_values == topic) & (partition_values == partition)
            if mask.any():
                yield (topic, int(partition)), offsets[mask]
