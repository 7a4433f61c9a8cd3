"""Where things live in an output directory, and what a segment's name claims.

    DIR/vectors/<topic>-p<partition:05d>-<first:020d>.parquet   segments
    DIR/quarantine/                                             damaged segments, moved aside
    DIR/index/index.json -> DIR/index/shard-<generation>-<n>.faiss  (see sinks.index.shards)

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

An output is a local (or NFS) directory, a `Path`, or a bucket prefix on an
S3-compatible store, an `ObjectStore` (`--output s3://bucket/prefix`): the same
names under the prefix, no temp files (a segment is uploaded whole, with a
create-if-absent PUT). Code that reads segments goes through `SegmentFile` and
sinks.segments, which read either.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol

VECTORS_DIR = "vectors"
INDEX_DIR = "index"
QUARANTINE_DIR = "quarantine"
INDEX_META_FILE = "index.json"
TMP_SUFFIX = ".tmp"
# In each vectors/ a compaction swaps in: a token no other holds (sinks.vectors_swap).
GENERATION_FILE = ".generation"
_LIST_ATTEMPTS = 5
_NAME = re.compile(
    r"^(?P<topic>.+)-p(?P<partition>\d{5})-(?P<first>\d{20})(?:-(?P<last>\d{20}))?\.parquet$"
)

TopicPartitionKey = tuple[str, int]


class Listed(Protocol):
    key: str


class Bucket(Protocol):
    """What the layout needs of an object-store output: sinks.objectstore.ObjectStore
    is the one implementation (the storage layer, above this one)."""

    @property
    def url(self) -> str: ...

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[Listed]: ...


# Where outputs live: a directory, or a bucket prefix on an object store.
Output = Path | Bucket


def is_local(output: Output) -> bool:
    return isinstance(output, Path)


def describe(output: Output) -> str:
    """The output as a user wrote it: a directory, or s3://bucket/prefix."""
    return str(output) if isinstance(output, Path) else output.url.rstrip("/")


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
    """A finished segment; `named_last` only for range names.

    `path` is the file in a local output, or the object's key (relative to the
    store's prefix) in an object-store output, which `store` then names.
    """

    key: SegmentKey
    path: Path | PurePosixPath
    named_last: int | None = None
    store: Bucket | None = field(default=None, compare=False, repr=False)

    @classmethod
    def parse(cls, path: Path | PurePosixPath, store: Bucket | None = None) -> SegmentFile | None:
        match = _NAME.match(path.name)
        if match is None:
            return None
        key = SegmentKey(match["topic"], int(match["partition"]), int(match["first"]))
        last = match["last"]
        return cls(key, path, int(last) if last is not None else None, store)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def where(self) -> str:
        """The file or object, for messages."""
        return str(self.path) if self.store is None else f"{self.store.url}{self.path}"


def vectors_key(name: str) -> str:
    """An object's key under an object-store output's prefix, in the vectors folder."""
    return f"{VECTORS_DIR}/{name}"


def vectors_dir(output: Path) -> Path:
    return output / VECTORS_DIR


def index_dir(output: Path) -> Path:
    return output / INDEX_DIR


def quarantine_dir(output: Path) -> Path:
    return output / QUARANTINE_DIR


def has_vectors(output: Output) -> bool:
    """Whether the output has a vectors folder (an object store: any object in it)."""
    if isinstance(output, Path):
        return vectors_dir(output).is_dir()
    return next(iter(output.list(f"{VECTORS_DIR}/", page_size=1)), None) is not None


def iter_segments(output: Output) -> Iterator[SegmentFile]:
    """Every finished segment of the output, in name order."""
    if not isinstance(output, Path):
        listed = (o for o in output.list(f"{VECTORS_DIR}/") if o.key.count("/") == 1)
        objects = (SegmentFile.parse(PurePosixPath(o.key), output) for o in listed)
        yield from sorted(s for s in objects if s is not None)
        return
    directory = vectors_dir(output)
    if not directory.is_dir():
        return
    found = (SegmentFile.parse(directory / name) for name in _names(directory))
    yield from sorted(s for s in found if s is not None)


def _names(directory: Path) -> list[str]:
    """The directory's entries, listed again where a compaction swapped it out
    during the listing: the old one's entries may go from under a listing of it,
    and where a partition's output ends must not be read from part of a listing."""
    for _ in range(_LIST_ATTEMPTS):
        before = directory_identity(directory)
        names = os.listdir(directory)
        if directory_identity(directory) == before:
            break
    return names


def directory_identity(directory: Path) -> tuple[int, int, str | None] | None:
    """Which directory the path names now: its inode and, read through the same open
    directory, its compaction token (inode numbers are reused once one is gone)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        try:
            token_fd = os.open(GENERATION_FILE, os.O_RDONLY, dir_fd=fd)
        except FileNotFoundError:
            return (st.st_dev, st.st_ino, None)  # never compacted
        try:
            return (st.st_dev, st.st_ino, os.read(token_fd, 64).decode())
        finally:
            os.close(token_fd)
    finally:
        os.close(fd)


def segments_by_partition(
    output: Output, topics: Iterable[str] | None = None
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
