"""What a segment says about itself, and what to do with one that is damaged.

A segment's Parquet footer records the offset range it covers and how many
records the worker consumed in it (`segment.*` key-value metadata), so that the
range can be read without reading the rows. A segment whose footer cannot be
read (truncated, overwritten, not Parquet) is *damaged*: workers move it aside
into `DIR/quarantine/` with a JSON note of the range it held, and the range is
read again from Kafka (see `consumers.repair`). Readers (the index, status,
audit) skip damaged segments with a warning and never crash on them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.documents import DELETED
from pipeline.core.errors import OutputError
from pipeline.core.layout import QUARANTINE_DIR, Output, SegmentFile, describe, quarantine_dir
from sinks.vectors_swap import VectorsLock

if TYPE_CHECKING:
    from sinks.objectstore import ObjectStore

log = logging.getLogger(__name__)

META_PREFIX = "segment."
# How a partition's first segment came to start where it does, when that is not
# where the partition (or the previous segment) ends: the user chose it.
START_FROM_COMMITTED = "from-committed"
DEAD_LETTERS_KEY = f"{META_PREFIX}dead_letters_from"
# Upsert mode: offset ranges whose rows `pipeline compact --purge` erased (superseded
# and deleted documents), as JSON [[first, last], ...]: accounted for, not missing.
PURGED_KEY = f"{META_PREFIX}purged"
# Chunked outputs (pipeline.core.chunks.Chunking.as_metadata): a record is a row per
# chunk, so a footer's row count is not a count of records.
CHUNKING_KEY = "chunking.tokens"


@dataclass(frozen=True)
class DeadLetterMark:
    """Where in the dead-letter topic the dead letters of this segment's partition past
    its last offset begin: every one of them lies at or after `offset` of `partition`
    (consumers.dead_letters). The next owner reads from here what was sent already."""

    topic: str
    partition: int
    offset: int

    def to_text(self) -> str:
        return json.dumps({"topic": self.topic, "partition": self.partition, "offset": self.offset})

    @classmethod
    def from_text(cls, text: str | None) -> DeadLetterMark | None:
        """The mark in a footer; None when absent (older writers) or unreadable."""
        if not text:
            return None
        try:
            data = json.loads(text)
            return cls(str(data["topic"]), int(data["partition"]), int(data["offset"]))
        except (ValueError, TypeError, KeyError):
            log.warning("segment metadata %s=%r is unreadable; ignored", DEAD_LETTERS_KEY, text)
            return None


@dataclass(frozen=True)
class SegmentInfo:
    file: SegmentFile
    first: int
    last: int
    rows: int
    records: int | None  # records consumed in the range, good and bad (None: legacy file)
    start: str | None = None
    dead_letters: DeadLetterMark | None = None
    purged: tuple[tuple[int, int], ...] = ()  # ranges of erased rows (PURGED_KEY)
    chunked: bool = False  # rows are chunks of records (CHUNKING_KEY): rows != records

    @property
    def purged_count(self) -> int:
        return sum(last - first + 1 for first, last in self.purged)

    @property
    def dead_lettered(self) -> int | None:
        """Records of the range in no row (None: unknown from the footer: a legacy file,
        or a chunked one, whose rows are chunks)."""
        if self.records is None or self.chunked:
            return None
        return self.records - self.rows - self.purged_count


class DamagedSegment(OutputError):
    """A finished segment whose footer cannot be read."""

    def __init__(self, segment: SegmentFile, reason: str) -> None:
        super().__init__(f"damaged segment {segment.where}: {reason}")
        self.segment = segment
        self.reason = reason


def segment_metadata(
    first: int,
    last: int,
    records: int,
    writer: str,
    start: str | None = None,
    dead_letters: DeadLetterMark | None = None,
    purged: Sequence[tuple[int, int]] = (),
) -> dict[str, str]:
    meta = {
        f"{META_PREFIX}first_offset": str(first),
        f"{META_PREFIX}last_offset": str(last),
        f"{META_PREFIX}records": str(records),
        f"{META_PREFIX}writer": writer,
    }
    if start is not None:
        meta[f"{META_PREFIX}start"] = start
    if dead_letters is not None:
        meta[DEAD_LETTERS_KEY] = dead_letters.to_text()
    if purged:
        meta[PURGED_KEY] = json.dumps([list(r) for r in purged])
    return meta


def read_info(segment: SegmentFile) -> SegmentInfo:
    """The segment's range and counts, from its footer; DamagedSegment if unreadable.

    On an object store, only the object's tail is fetched, and a failure to fetch
    it is an OutputError (the store is unwell), never taken for damage.
    """
    try:
        if segment.store is None:
            footer = pq.read_metadata(segment.path)
        else:
            with segment.store.open_ranged(str(segment.path)) as ranged:
                footer = pq.read_metadata(pa.PythonFile(ranged, mode="r"))
    except FileNotFoundError:
        raise
    except (OSError, pa.ArrowException) as exc:
        raise DamagedSegment(segment, str(exc)) from exc
    return info_from_metadata(segment, footer.metadata, footer.num_rows)


def read_schema(segment: SegmentFile) -> pa.Schema:
    """The segment's schema with its key-value metadata (from the footer)."""
    if segment.store is None:
        return pq.read_schema(segment.path)
    with segment.store.open_ranged(str(segment.path)) as ranged:
        return pq.read_schema(pa.PythonFile(ranged, mode="r"))


def read_table(
    segment: SegmentFile, columns: Sequence[str] | None = None, optional: Sequence[str] = ()
) -> pa.Table:
    """The segment's rows (the given columns, and those of `optional` it has), as pyarrow
    reads them: ArrowException or OSError when damaged, FileNotFoundError when gone."""
    source: Any = segment.path
    if segment.store is not None:
        source = pa.BufferReader(segment.store.get(str(segment.path)))
    if columns is not None and optional:
        names = set(pq.read_schema(source).names)
        columns = [*columns, *(c for c in optional if c in names)]
    return pq.read_table(source, columns=None if columns is None else list(columns))


def segment_size(segment: SegmentFile) -> int:
    if segment.store is None:
        return segment.path.stat().st_size
    return segment.store.size(str(segment.path))


def info_from_metadata(
    segment: SegmentFile, metadata: Mapping[bytes, bytes] | None, rows: int
) -> SegmentInfo:
    """The segment's range and counts from its key-value metadata (footer or schema)."""
    raw = {k.decode(): v.decode() for k, v in (metadata or {}).items()}
    first_text = raw.get(f"{META_PREFIX}first_offset")
    last_text = raw.get(f"{META_PREFIX}last_offset")
    if first_text is None or last_text is None:
        if segment.named_last is None:
            raise DamagedSegment(segment, "no segment range in its metadata")
        return SegmentInfo(segment, segment.key.first, segment.named_last, rows, None)
    first, last = int(first_text), int(last_text)
    if first != segment.key.first or last < first:
        raise DamagedSegment(segment, f"metadata range {first}..{last} does not match its name")
    records = int(raw.get(f"{META_PREFIX}records", rows))
    start = raw.get(f"{META_PREFIX}start")
    mark = DeadLetterMark.from_text(raw.get(DEAD_LETTERS_KEY))
    purged = _ranges(segment, raw.get(PURGED_KEY))
    chunked = CHUNKING_KEY in raw
    return SegmentInfo(segment, first, last, rows, records, start, mark, purged, chunked)


def _ranges(segment: SegmentFile, text: str | None) -> tuple[tuple[int, int], ...]:
    if not text:
        return ()
    try:
        return tuple((int(a), int(b)) for a, b in json.loads(text))
    except (ValueError, TypeError) as exc:
        raise DamagedSegment(segment, f"unreadable {PURGED_KEY}: {exc}") from exc


def read_rows(
    segment: SegmentFile, columns: Sequence[str], optional: Sequence[str] = ()
) -> tuple[pa.Table, SegmentInfo]:
    """The segment's columns (and those of `optional` it has) and range; DamagedSegment
    if it cannot be read."""
    try:
        table = read_table(segment, columns, optional)
    except FileNotFoundError:
        raise
    except (OSError, pa.ArrowException) as exc:
        raise DamagedSegment(segment, str(exc)) from exc
    return table, info_from_metadata(segment, table.schema.metadata, table.num_rows)


def last_offset(segment: SegmentFile) -> int:
    """The last offset a segment covers (legacy names say it; new ones need the footer)."""
    if segment.named_last is not None:
        return segment.named_last
    return read_info(segment).last


def segments_past(segments: Sequence[SegmentFile], through: int) -> list[SegmentFile]:
    """Of a partition's segments (in offset order), those that may hold rows past
    `through`: the ones starting after it, and the last one starting at or before it
    where that runs past it (one written again after its partition's damaged last
    segment, or a merged one). One unreadable now is left to the worker that repairs it."""
    later = [s for s in segments if s.key.first > through]
    earlier = [s for s in segments if s.key.first <= through]
    if earlier:
        try:
            if last_offset(earlier[-1]) > through:
                later.insert(0, earlier[-1])
        except (DamagedSegment, FileNotFoundError):
            pass
    return later


def with_vectors(table: pa.Table) -> np.ndarray:
    """Which of a segment's rows hold a vector: all but upsert mode's deletion rows."""
    if DELETED not in table.column_names:
        return np.ones(table.num_rows, dtype=bool)
    return ~table.column(DELETED).to_numpy(zero_copy_only=False)


def covered_through(segments: Sequence[SegmentFile]) -> int | None:
    """The last offset the partition's segments cover; None when there are none.

    Only the segment with the highest first offset needs its footer read, since
    segments tile; legacy names (which carry their last offset) are taken as
    they are, overlaps included. A damaged last segment raises DamagedSegment.
    """
    if not segments:
        return None
    high = max((s.named_last for s in segments if s.named_last is not None), default=None)
    newest = max(segments, key=lambda s: s.key.first)
    last = last_offset(newest)
    return last if high is None else max(high, last)


def segment_before(segments: Sequence[SegmentFile], offset: int) -> SegmentInfo | None:
    """The segment that ends right before `offset` (None: none does, or it cannot be read)."""
    earlier = [s for s in segments if s.key.first < offset]
    if not earlier:
        return None
    newest = max(earlier, key=lambda s: s.key.first)
    try:
        info = read_info(newest)
    except (DamagedSegment, FileNotFoundError):
        return None
    return info if info.last == offset - 1 else None


# --------------------------------------------------------------------------- quarantine


@dataclass
class QuarantineNote:
    """What a damaged segment held, kept beside it so that its range can be read again."""

    file: str
    topic: str
    partition: int
    first: int
    last: int | None  # known when the footer was readable, else found from neighbours
    reason: str
    moved_at: float
    repaired: bool = False
    lost: bool = False  # Kafka no longer retains the range

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> QuarantineNote:
        data: Mapping[str, object] = json.loads(text)
        return cls(**data)  # type: ignore[arg-type]


def quarantine(output: Output, segment: SegmentFile, reason: str) -> QuarantineNote | None:
    """Moves a damaged segment into DIR/quarantine/ with a note; None if it is already gone."""
    stamp = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.urandom(3).hex()}"
    moved_name = f"{segment.name}.{stamp}"
    if isinstance(output, Path):
        if not _move_aside(output, segment, moved_name):
            return None
    elif not _copy_aside(output, segment, moved_name):
        return None
    note = QuarantineNote(
        file=moved_name,
        topic=segment.key.topic,
        partition=segment.key.partition,
        first=segment.key.first,
        last=segment.named_last,
        reason=reason,
        moved_at=time.time(),
    )
    save_note(output, note)
    log.warning(
        "damaged segment %s (%s) moved to %s/%s/%s; its records will be read again from Kafka",
        segment.name,
        reason,
        describe(output),
        QUARANTINE_DIR,
        moved_name,
    )
    return note


def _move_aside(output: Path, segment: SegmentFile, moved_name: str) -> bool:
    directory = quarantine_dir(output)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with VectorsLock(output).shared():  # not resurrected by a compaction's exchange
            os.rename(segment.path, directory / moved_name)
    except FileNotFoundError:
        return False  # another worker moved it first
    except OSError as exc:
        raise OutputError(f"cannot move damaged segment {segment.where} aside: {exc}") from exc
    return True


def _copy_aside(store: ObjectStore, segment: SegmentFile, moved_name: str) -> bool:
    """An object store has no rename: the object is copied, then deleted. Two workers
    doing it at once both copy; the second note is closed by the first repair."""
    try:
        data = store.get(str(segment.path))
    except FileNotFoundError:
        return False
    store.put(f"{QUARANTINE_DIR}/{moved_name}", data)
    store.delete(str(segment.path))
    return True


def save_note(output: Output, note: QuarantineNote) -> None:
    name = f"{note.file}.json"
    if not isinstance(output, Path):
        output.put(f"{QUARANTINE_DIR}/{name}", note.to_json().encode())
        return
    path = quarantine_dir(output) / name
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(note.to_json(), encoding="utf-8")
    os.replace(tmp, path)


def pending_notes(output: Output) -> list[QuarantineNote]:
    """Notes of damaged segments whose range has not been read again yet."""
    notes = []
    for where, read in _note_files(output):
        try:
            note = QuarantineNote.from_json(read())
        except FileNotFoundError:
            continue
        except (OSError, ValueError, TypeError) as exc:
            log.warning("unreadable quarantine note %s: %s", where, exc)
            continue
        if not note.repaired and not note.lost:
            notes.append(note)
    return notes


def _note_files(output: Output) -> list[tuple[str, Callable[[], str]]]:
    """(where, read its text) of every quarantine note, in name order."""
    if not isinstance(output, Path):
        store = output
        keys = [o.key for o in store.list(f"{QUARANTINE_DIR}/") if o.key.endswith(".json")]
        return [(f"{store.url}{k}", lambda k=k: store.get(k).decode("utf-8")) for k in keys]
    directory = quarantine_dir(output)
    if not directory.is_dir():
        return []
    paths = sorted(directory.glob("*.json"))
    return [(str(p), lambda p=p: p.read_text(encoding="utf-8")) for p in paths]
