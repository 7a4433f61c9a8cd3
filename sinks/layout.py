"""Where things live in an output directory, and how file names encode coverage.

    DIR/vectors/<topic>-p<partition:05d>-<first:020d>-<last:020d>.parquet
    DIR/index/index.json -> DIR/index/index-<generation>.faiss (see sinks.faiss_index)

A Parquet file covers every offset from `first` to `last` of one partition: its
rows are the good records in that range; the bad ones went to the dead-letter
topic. (A range with only bad records gives a file with no rows, so that the
output directory alone says how far each partition was processed.) Files that
are still being written end in `.tmp`, never in `.parquet`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

VECTORS_DIR = "vectors"
INDEX_DIR = "index"
INDEX_META_FILE = "index.json"
TMP_SUFFIX = ".tmp"
_NAME = re.compile(
    r"^(?P<topic>.+)-p(?P<partition>\d{5})-(?P<first>\d{20})-(?P<last>\d{20})\.parquet$"
)


@dataclass(frozen=True, order=True)
class SegmentName:
    """The coverage a Parquet file name records: offsets first..last of one partition."""

    topic: str
    partition: int
    first: int
    last: int

    @property
    def filename(self) -> str:
        return f"{self.topic}-p{self.partition:05d}-{self.first:020d}-{self.last:020d}.parquet"

    @classmethod
    def parse(cls, filename: str) -> SegmentName | None:
        match = _NAME.match(filename)
        if match is None:
            return None
        return cls(match["topic"], int(match["partition"]), int(match["first"]), int(match["last"]))


def vectors_dir(output: Path) -> Path:
    return output / VECTORS_DIR


def index_dir(output: Path) -> Path:
    return output / INDEX_DIR


def iter_segments(output: Path) -> Iterator[tuple[SegmentName, Path]]:
    """Every finished Parquet file of the output directory, in name order."""
    directory = vectors_dir(output)
    if not directory.is_dir():
        return
    for path in sorted(directory.iterdir()):
        name = SegmentName.parse(path.name)
        if name is not None:
            yield name, path


def written_high_offsets(output: Path) -> dict[tuple[str, int], int]:
    """The last offset covered by finished files, per (topic, partition)."""
    high: dict[tuple[str, int], int] = {}
    for name, _ in iter_segments(output):
        key = (name.topic, name.partition)
        high[key] = max(high.get(key, -1), name.last)
    return high
