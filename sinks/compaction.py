"""`pipeline compact`: merges runs of small segments into large ones, atomically.

A partition's segments tile its offsets; a nearline worker writing one batch a
second leaves tens of thousands of small files a day, which every reader pays
for. Compaction merges runs of consecutive small segments of one partition
(each run contiguous, one model's vectors, up to `target_bytes`) into one
segment named by its range, `<topic>-p<partition>-<first>-<last>.parquet`. The
merged file keeps what the sources said: their rows in offset order, the range
they covered, the records they consumed, how the first one started.

A chunked output's record is a row per chunk, all in one segment: a run takes
whole segments, so a record's rows stay in one file, and they are written in
(offset, chunk) order (a source found in another order is sorted, stably). Only
segments of one model, one chunking and one set of columns are merged.

The order of things, and why a crash anywhere leaves a readable dataset with
every row once:

1. merged files are written and fsynced in `DIR/.compact-<token>/`, which no
   reader lists;
2. under the exclusive vectors lock (see sinks.vectors_swap), the next
   `vectors/` is built beside the current one: hard links of every file but the
   sources, the merged files, and the fences of the merged ranges;
3. one `renameat2(RENAME_EXCHANGE)` swaps it in: the commit point;
4. the staging directory is removed; the old directory, now at the side, is
   kept there for RETIRED_GRACE_S (a reader may still be listing it: see
   sinks.vectors_swap) and removed by a later run once that long has passed,
   or by `settle` (`pipeline compact` waits for it); a later run also removes
   what a crash left.

Offsets stay recoverable: the merged file covers exactly its sources' range,
so where each partition ends, and so where a restarted worker starts, does not
change. The index does not change either: its ids are offsets.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.chunks import CHUNK
from pipeline.core.errors import OutputError
from pipeline.core.layout import (
    Output,
    SegmentFile,
    TopicPartitionKey,
    describe,
    segments_by_partition,
    vectors_dir,
)
from sinks.parquet import CODEC, EMBEDDING_LEAF, fsync_dir, output_error
from sinks.segments import (
    META_PREFIX,
    DamagedSegment,
    SegmentInfo,
    info_from_metadata,
    segment_metadata,
)
from sinks.vectors_swap import (
    GENERATION_FILE,
    VectorsLock,
    exchange,
    link_tree,
    write_fences,
    write_generation,
)
from sinks.writers import WRITER

log = logging.getLogger(__name__)

DEFAULT_TARGET_BYTES = 128 << 20
# Row groups of merged files: up to this many rows, and up to ROW_GROUP_BYTES of
# Arrow data, which is what compaction holds at a time (sources are read in
# batches): large enough for fast scans, small enough that a reader of a few rows
# does not decode a whole file and that a worker compacting beside its batches
# stays near its working set (a larger group is held twice while concatenated, and
# showed in the peak RSS of a worker under a backlog: docs/performance.md).
ROW_GROUP_ROWS = 64 * 1024
ROW_GROUP_BYTES = 24 << 20
_READ_BATCH_ROWS = 4096
_COMPACTOR_LOCK = ".compact.lock"
_STAGING = ".compact-"
_NEXT = ".vectors.next-"
_RETIRED = ".vectors.retired-"
# How long a swapped-aside vectors/ stays for readers listing it at the exchange
# (a listing takes milliseconds; this covers a reader descheduled midway).
RETIRED_GRACE_S = 5.0


@dataclass(frozen=True)
class Run:
    """Consecutive segments of one partition to merge into one."""

    key: TopicPartitionKey
    sources: tuple[SegmentInfo, ...]

    @property
    def first(self) -> int:
        return self.sources[0].first

    @property
    def last(self) -> int:
        return self.sources[-1].last

    @property
    def name(self) -> str:
        topic, partition = self.key
        return f"{topic}-p{partition:05d}-{self.first:020d}-{self.last:020d}.parquet"


@dataclass(frozen=True)
class Erasure:
    """Rows a purge erases (upsert mode: sinks.purge): per partition, those at or below
    `through` whose offset is not in `keep` (sorted)."""

    through: Mapping[TopicPartitionKey, int]
    keep: Mapping[TopicPartitionKey, np.ndarray]

    def mask(self, key: TopicPartitionKey, offsets: np.ndarray) -> np.ndarray:
        """Which of `offsets` (of partition `key`) are erased."""
        through = self.through.get(key)
        if through is None:
            return np.zeros(len(offsets), dtype=bool)
        return (offsets <= through) & ~np.isin(offsets, self.keep.get(key, _NONE))

    @staticmethod
    def purged(
        before: Iterable[tuple[int, int]], erased: list[np.ndarray]
    ) -> list[tuple[int, int]]:
        """A footer's purged ranges: those it named `before`, and the `erased` offsets."""
        return _merge_ranges([*before, *_ranges_of(erased)])


_NONE = np.empty(0, dtype=np.int64)


@dataclass
class CompactionReport:
    files_before: int = 0
    files_after: int = 0
    runs: int = 0
    merged_files: int = 0
    rows: int = 0
    erased: int = 0  # rows a purge erased
    bytes_read: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def compact(
    output: Output,
    target_bytes: int = DEFAULT_TARGET_BYTES,
    dry_run: bool = False,
    should_stop: Callable[[], bool] = lambda: False,
    erase: Erasure | None = None,
) -> CompactionReport:
    """Merges runs of small segments in `output`; see the module docstring.

    `should_stop` is asked between merged files: a stopping worker abandons the
    run (nothing visible changed yet) rather than holding up its shutdown. With
    `erase`, the rows it names leave every segment holding one (a run of one segment
    where no merge takes it), their offsets recorded as purged in the footer."""
    if not isinstance(output, Path):
        raise OutputError(
            f"{describe(output)}: compaction of object-store outputs is not supported yet "
            "(a listing there cannot switch from small files to merged ones at once); "
            "larger --batch-size and --poll-timeout-ms make fewer, larger segments"
        )
    try:
        return _compact(output, target_bytes, dry_run, should_stop, erase)
    except OSError as exc:  # disk full, permissions: one line, as for a worker's writes
        raise output_error(exc, output) from exc


def _compact(
    output: Path,
    target_bytes: int,
    dry_run: bool,
    should_stop: Callable[[], bool],
    erase: Erasure | None,
) -> CompactionReport:
    started = time.perf_counter()
    report = CompactionReport()
    with _only_compactor(output):
        _remove_leftovers(output)
        _remove_retired(output, RETIRED_GRACE_S)
        segments = segments_by_partition(output)
        report.files_before = sum(len(s) for s in segments.values())
        runs = [
            run for key, parts in segments.items() for run in plan_runs(key, parts, target_bytes)
        ]
        if erase is not None:
            runs += _erasing_runs(segments, runs, erase)
        report.runs = len(runs)
        report.rows = sum(info.rows for run in runs for info in run.sources)
        report.merged_files = sum(len(run.sources) for run in runs)
        if dry_run or not runs:
            report.files_after = report.files_before - report.merged_files + len(runs)
        else:
            staging = output / f"{_STAGING}{WRITER}"
            staging.mkdir()
            try:
                for run in runs:
                    if should_stop():
                        report.skipped.append("stopped before the exchange")
                        return report
                    read, erased = _write_merged(run, staging / run.name, erase)
                    report.bytes_read += read
                    report.erased += erased
                fsync_dir(staging)
                _swap_in(output, staging, runs, segments, report)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            report.files_after = sum(len(s) for s in segments_by_partition(output).values())
    report.seconds = time.perf_counter() - started
    return report


def plan_runs(key: TopicPartitionKey, segments: list[SegmentFile], target_bytes: int) -> list[Run]:
    """Runs of at least two consecutive small segments, each run within target_bytes."""
    runs: list[Run] = []
    current: list[SegmentInfo] = []
    size = 0
    model: dict[bytes, bytes] | None = None

    def close() -> None:
        nonlocal current, size
        if len(current) >= 2:
            runs.append(Run(key, tuple(current)))
        current, size = [], 0

    for segment in segments:
        info, file_size, embedding = _describe(segment)
        small = info is not None and info.records is not None and file_size * 2 <= target_bytes
        if not small or info is None:
            close()
            continue
        joins = (
            current
            and info.first == current[-1].last + 1
            and info.start is None
            and embedding == model
            and size + file_size <= target_bytes
        )
        if not joins:
            close()
        if not current:
            model = embedding
        current.append(info)
        size += file_size
    close()
    return runs


def _describe(segment: SegmentFile) -> tuple[SegmentInfo | None, int, dict[bytes, bytes]]:
    """A segment's footer facts, its size and what segments merged with it must share:
    its model and chunking metadata and its columns; None if unusable."""
    try:
        footer = pq.read_metadata(segment.path)
        info = info_from_metadata(segment, footer.metadata, footer.num_rows)
        size = segment.path.stat().st_size
        columns = ",".join(footer.schema.to_arrow_schema().names).encode()
    except (DamagedSegment, OSError, pa.ArrowException):
        return None, 0, {}  # a worker quarantines it; never merged
    raw = footer.metadata or {}
    kind = {k: v for k, v in raw.items() if k.startswith((b"embedding.", b"chunking."))}
    return info, size, {**kind, b"columns": columns}


def _erasing_runs(
    segments: dict[TopicPartitionKey, list[SegmentFile]], runs: list[Run], erase: Erasure
) -> list[Run]:
    """A run of one segment for each segment that holds erased rows and no run takes."""
    taken = {info.file.path for run in runs for info in run.sources}
    found = []
    for key, parts in segments.items():
        for segment in parts:
            if segment.path in taken:
                continue
            info, _, _ = _describe(segment)
            if info is None or info.records is None:
                continue  # damaged (a worker quarantines it) or legacy: left as it is
            offsets = pq.read_table(segment.path, columns=["offset"]).column("offset")
            if erase.mask(key, offsets.to_numpy().astype(np.int64)).any():
                found.append(Run(key, (info,)))
    return found


def _write_merged(run: Run, path: Path, erase: Erasure | None = None) -> tuple[int, int]:
    """Writes the run's rows (less those `erase` names), in offset order, with the run's
    range; returns (bytes read, rows erased)."""
    first_schema = pq.read_schema(run.sources[0].file.path)
    raw = {k.decode(): v.decode() for k, v in (first_schema.metadata or {}).items()}
    kept = {k: v for k, v in raw.items() if not k.startswith(META_PREFIX)}
    records = sum(info.records or 0 for info in run.sources)
    erased: list[np.ndarray] = []
    batches = _batches(run, erase, erased)
    bytes_read = sum(info.file.path.stat().st_size for info in run.sources)
    # The footer names the erased offsets, known once the rows are read: a purge reads
    # them first (at most a merge's target size, held once).
    if erase is not None:
        batches = iter(list(batches))
    purged = Erasure.purged([r for info in run.sources for r in info.purged], erased)
    # The run's first start note, and its last segment's dead-letter mark: the next owner
    # of the partition reads dead letters from where the newest segment says.
    meta = segment_metadata(
        run.first,
        run.last,
        records,
        f"compact:{WRITER}",
        run.sources[0].start,
        run.sources[-1].dead_letters,
        purged,
    )
    schema = first_schema.with_metadata({**kept, **meta})
    pending: list[pa.RecordBatch] = []
    with open(path, "wb") as fh:
        with pq.ParquetWriter(
            fh,
            schema,
            compression=CODEC,
            use_dictionary=["topic"],
            use_byte_stream_split=[EMBEDDING_LEAF],
        ) as writer:
            pending_rows = pending_bytes = 0

            def write_pending() -> None:
                nonlocal pending_rows, pending_bytes
                # One row group; the batches are chunks of it, not copied into one.
                table = pa.Table.from_batches(pending, schema)
                writer.write_table(table, row_group_size=table.num_rows)
                pending.clear()
                pending_rows = pending_bytes = 0

            for batch in batches:
                pending.append(pa.Table.from_batches([batch]).cast(schema).to_batches()[0])
                pending_rows += batch.num_rows
                pending_bytes += batch.nbytes
                if pending_rows >= ROW_GROUP_ROWS or pending_bytes >= ROW_GROUP_BYTES:
                    write_pending()
            if pending:
                write_pending()
        fh.flush()
        os.fsync(fh.fileno())
    return bytes_read, sum(len(e) for e in erased)


def _batches(run: Run, erase: Erasure | None, erased: list[np.ndarray]) -> Iterator[pa.RecordBatch]:
    """The run's rows in batches, less those `erase` names (their offsets: to `erased`;
    a record's chunk rows share its offset, so all of them go)."""
    for info in run.sources:
        for batch in _source_batches(info.file.path):
            if erase is not None and batch.num_rows:
                offsets = batch.column("offset").to_numpy().astype(np.int64)
                mask = erase.mask(run.key, offsets)
                if mask.any():
                    erased.append(offsets[mask])
                    batch = batch.filter(pa.array(~mask))
            if batch.num_rows:
                yield batch


def _source_batches(path: Path) -> Iterator[pa.RecordBatch]:
    """A source segment's rows in batches; a chunked one's in (offset, chunk) order (a
    worker writes them so; one found otherwise is read whole and sorted, stably)."""
    source = pq.ParquetFile(path)
    if CHUNK in source.schema_arrow.names and not _in_record_order(source):
        table = source.read().sort_by([("offset", "ascending"), (CHUNK, "ascending")])
        yield from table.to_batches(max_chunksize=_READ_BATCH_ROWS)
        return
    yield from source.iter_batches(batch_size=_READ_BATCH_ROWS)


def _in_record_order(source: pq.ParquetFile) -> bool:
    """Whether a chunked segment's rows run in (offset, chunk) order."""
    keys = source.read(columns=["offset", CHUNK])
    offsets = keys.column("offset").to_numpy().astype(np.int64)
    chunks = keys.column(CHUNK).fill_null(-1).to_numpy().astype(np.int64)
    later, same = offsets[1:] > offsets[:-1], offsets[1:] == offsets[:-1]
    return bool(np.all(later | (same & (chunks[1:] >= chunks[:-1]))))


def _ranges_of(parts: list[np.ndarray]) -> list[tuple[int, int]]:
    """Offsets (repeats allowed: a record's chunk rows) as runs of consecutive ones:
    [(first, last), ...]."""
    if not parts:
        return []
    offsets = np.unique(np.concatenate(parts))
    breaks = np.flatnonzero(np.diff(offsets) != 1)
    starts = np.concatenate([[0], breaks + 1])
    ends = np.concatenate([breaks, [len(offsets) - 1]])
    return [(int(offsets[a]), int(offsets[b])) for a, b in zip(starts, ends, strict=True)]


def _merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(last, merged[-1][1]))
        else:
            merged.append((first, last))
    return merged


def _swap_in(
    output: Path,
    staging: Path,
    runs: list[Run],
    segments: dict[TopicPartitionKey, list[SegmentFile]],
    report: CompactionReport,
) -> None:
    current = vectors_dir(output)
    upcoming = output / f"{_NEXT}{WRITER}"
    own_generation = current / GENERATION_FILE
    with VectorsLock(output).exclusive():
        live = [run for run in runs if all(i.file.path.exists() for i in run.sources)]
        for run in runs:
            if run not in live:  # a worker quarantined a source meanwhile
                report.skipped.append(f"{run.name}: a source vanished")
        if not live:
            return
        sources = {info.file.path for run in live for info in run.sources}
        link_tree(current, upcoming, sources | {own_generation})
        for run in live:
            os.link(staging / run.name, upcoming / run.name)
        for key in {run.key for run in live}:
            write_fences(upcoming, *key, _merged_ranges(key, segments, live))
        write_generation(upcoming)
        fsync_dir(upcoming)
        exchange(current, upcoming)
        fsync_dir(output)
    report.runs = len(live)
    # The old vectors/, swapped aside: kept a while for readers still listing it.
    os.rename(upcoming, output / f"{_RETIRED}{time.time_ns():020d}-{WRITER}")


def settle(output: Path) -> None:
    """Removes the old directories compactions swapped aside, once each has been
    aside RETIRED_GRACE_S (waiting for that: seconds at most)."""
    youngest = max(map(_retired_at, _retired(output)), default=None)
    if youngest is not None:
        # Clamped: a wall clock set back must not make this wait long.
        time.sleep(min(RETIRED_GRACE_S, max(0.0, RETIRED_GRACE_S - (time.time() - youngest))))
    _remove_retired(output, RETIRED_GRACE_S)


def _retired(output: Path) -> list[Path]:
    return [p for p in output.iterdir() if p.name.startswith(_RETIRED) and p.is_dir()]


def _retired_at(path: Path) -> float:
    """When a directory was swapped aside (its name says), in seconds since the epoch."""
    try:
        return int(path.name[len(_RETIRED) :].split("-")[0]) / 1e9
    except ValueError:
        return 0.0  # not named by us: old enough


def _remove_retired(output: Path, older_than_s: float) -> None:
    now = time.time()
    for path in _retired(output):
        if now - _retired_at(path) >= older_than_s:
            shutil.rmtree(path, ignore_errors=True)


def _merged_ranges(
    key: TopicPartitionKey, segments: dict[TopicPartitionKey, list[SegmentFile]], runs: list[Run]
) -> list[tuple[int, int]]:
    """The partition's ranges held by range-named files after this compaction."""
    merged_away = {info.file.path for run in runs for info in run.sources}
    ranges = [
        (s.key.first, s.named_last)
        for s in segments.get(key, [])
        if s.named_last is not None and s.path not in merged_away
    ]
    ranges += [(run.first, run.last) for run in runs if run.key == key]
    return ranges


@contextmanager
def _only_compactor(output: Path) -> Iterator[None]:
    try:
        fh = open(output / _COMPACTOR_LOCK, "a+b")  # noqa: SIM115 - held for the block
    except OSError as exc:
        raise OutputError(f"cannot use {output}: {exc}") from exc
    with fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputError(f"another compaction of {output} is running") from None
        yield


def _remove_leftovers(output: Path) -> None:
    """What a crashed compaction left: never listed by readers, safe to remove."""
    for path in output.iterdir():
        if path.name.startswith((_STAGING, _NEXT)) and path.is_dir():
            log.info("removing %s, left by an interrupted compaction", path)
            shutil.rmtree(path, ignore_errors=True)
