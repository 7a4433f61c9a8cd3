"""Where things live in an output directory, and what a segment's name claims.

    DIR/vectors/<topic>-p<partition:05d>-<first:020d>.parquet   segments
    DIR/quarantine/                                             damaged segments, moved aside
    DIR/index/index.json -> DIR/index/shard-<generation>-<n>.faiss  (see sinks.index_shards)

A segment covers every offset from its first to its last of one partition: its
rows are the good records in that range; the bad ones went to the dead-letter
topic, and offsets without a record (transaction markers, compacted records)
are covered too. Consecutive segments of a partition tile its offsets, so the
output directory alone says how far each partition was processed. (A range with
no good record gives a segment with no rows.)

The name holds only the first offset, and that is deliberate: publishing is a
create-if-absent of that name, so two writers that both believe they own a
partition (a stalled worker that comes back, and the new owner) race for the
same name and exactly one wins. The last offset is in the file's metadata.

Range names, `<first>-<last>.parquet`, are written by compaction (see
sinks.compaction, which also fences the merged range against late writers) and
were written by versions before the scheme above; both are read alike.

Files still being written start with a dot and end in `.tmp`, never `.parquet`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

VECTORS_DIR = "vectors"
INDEX_DIR = "index"
QUARANTINE_DIR = "quarantine"
INDEX_META_FILE = "index.json"
TMP_SUFFIX = ".tmp"
_NAME = re.compile(
    r"^(?P<topic>.+)-p(?P<partition>\d{5})-(?P<first>\d{20})(?:-(?P<last>\d{20}))?\.parquet$"
)

TopicPartitionKey = tuple[str, int]


@dataclass(frozen=True, order=True)
class SegmentKey:
    """What publishing a segment claims: offsets of one partition from `first` on."""

    topic: str
    partition: int
    first: int

    @property
    def filename(self) -> str:
        return f"{self.topic}-p{self.partition:05d}-{self.first:020d}.parquet"

    @property
    def partition_key(self) -> TopicPartitionKey:
        return (self.topic, self.partition)


@dataclass(frozen=True, order=True)
class SegmentFile:
    """A finished segment in the directory; `named_last` only for range names."""

    key: SegmentKey
    path: Path
    named_last: int | None = None

    @classmethod
    def parse(cls, path: Path) -> SegmentFile | None:
        match = _NAME.match(path.name)
        if match is None:
            return None
        key = SegmentKey(match["topic"], int(match["partition"]), int(match["first"]))
        last = match["last"]
        return cls(key, path, int(last) if last is not None else None)


def vectors_dir(output: Path) -> Path:
    return output / VECTORS_DIR


def index_dir(output: Path) -> Path:
    return output / INDEX_DIR


def quarantine_dir(output: Path) -> Path:
    return output / QUARANTINE_DIR


def iter_segments(output: Path) -> Iterator[SegmentFile]:
    """Every finished segment of the output directory, in name order."""
    directory = vectors_dir(output)
    if not directory.is_dir():
        return
    found = (SegmentFile.parse(path) for path in directory.iterdir())
    yield from sorted(s for s in found if s is not None)


def segments_by_partition(
    output: Path, topics: Iterable[str] | None = None
) -> dict[TopicPartitionKey, list[SegmentFile]]:
    """Finished segments per (topic, partition), in offset order."""
    wanted = set(topics) if topics is not None else None
    grouped: dict[TopicPartitionKey, list[SegmentFile]] = defaultdict(list)
    for segment in iter_segments(output):
        if wanted is None or segment.key.topic in wanted:
            grouped[segment.key.partition_key].append(segment)
    for segments in grouped.values():
        segments.sort(key=lambda s: (s.key.first, s.named_last or 0))
    return dict(grouped)
