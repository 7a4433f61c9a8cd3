"""Readers of a chunked output (`pipeline run --chunk-tokens N`), where a record is a
row per chunk, all in one segment: the audit counts records and checks their chunks,
status compares rows with the index, compaction and purge keep a record's rows
together and in order, and the current view holds every chunk of each document's
latest version. Segments are built by hand with pyarrow, as the worker writes them
(the row format of issue 35); no broker."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.audit import (
    PartitionAudit,
    audit_partition,
    audit_report,
    bad_chunk_offsets,
    output_coverage,
    read_output_rows,
    render_audit,
    within,
)
from pipeline.audit.kafka_reads import DeadLetters
from pipeline.core.chunks import (
    CHAR_END,
    CHAR_START,
    CHUNK,
    CHUNK_COUNT,
    CHUNKED,
    TOKENS,
    TRUNCATED,
)
from pipeline.core.documents import DELETED, DOC_KEY
from pipeline.core.layout import SegmentKey, iter_segments, segments_by_partition, vectors_dir
from pipeline.status.outputs import PartitionOutput
from sinks.compaction import Erasure, compact
from sinks.parquet import schema as segment_schema
from sinks.segments import read_info, segment_metadata
from sinks.view import ViewStore, _record_end
from sinks.view_plan import plan

DIM = 4
TOPIC = "docs"
MODEL = {"embedding.model": "test-model", "embedding.dim": str(DIM)}
CHUNKING = {"chunking.tokens": "16", "chunking.overlap": "4"}

# --------------------------------------------------------------------------- building


@dataclass
class Record:
    """One record as the worker writes it: `chunks` rows (chunk 0..chunks-1), or the
    (chunk, chunk_count) pairs given in `rows` (to build broken ones)."""

    offset: int
    chunks: int = 1
    doc: str | None = None  # upsert mode: its document
    deleted: bool = False  # upsert mode: a tombstone's row
    rows: Sequence[tuple[int, int]] | None = None
    text: str | None = None

    def pairs(self) -> list[tuple[int, int]]:
        if self.rows is not None:
            return list(self.rows)
        return [(c, self.chunks) for c in range(self.chunks)]

    @property
    def whole(self) -> str:
        return self.text or f"record {self.offset} " * 3 * self.chunks


def rows_of(records: Iterable[Record], upsert: bool, partition: int = 0) -> pa.Table:
    """The segment rows of `records`, in the order given, with the chunked columns
    (and upsert mode's before them, after `embedding`)."""
    columns: dict[str, list[Any]] = {
        name: []
        for name in [
            "topic", "partition", "offset", "key", "id", "text", "timestamp", "metadata",
            "embedding",
            *([DOC_KEY, DELETED] if upsert else []),
            CHUNK, CHUNK_COUNT, CHAR_START, CHAR_END, TRUNCATED, TOKENS,
        ]
    }  # fmt: skip
    rng = np.random.default_rng(5)
    for record in records:
        text = "" if record.deleted else record.whole
        for chunk, count in record.pairs():
            step = max(1, len(text) // max(count, 1))
            start, end = (
                (0, 0) if record.deleted else (chunk * step, min(len(text), (chunk + 2) * step))
            )
            vector = np.zeros(DIM) if record.deleted else rng.standard_normal(DIM)
            values = {
                "topic": TOPIC, "partition": partition, "offset": record.offset,
                "key": (record.doc or "").encode(), "id": record.doc, "text": text[start:end],
                "timestamp": record.offset, "metadata": None,
                "embedding": (vector / (np.linalg.norm(vector) or 1)).astype(np.float32).tolist(),
                DOC_KEY: record.doc, DELETED: record.deleted, CHUNK: chunk, CHUNK_COUNT: count,
                CHAR_START: start, CHAR_END: end, TRUNCATED: False, TOKENS: 7,
            }  # fmt: skip
            for name in columns:
                columns[name].append(values[name])
    schema = segment_schema(DIM, upsert=upsert, rows=CHUNKED)
    return pa.table(columns, schema=schema)


def write_chunked(
    root: Path,
    first: int,
    last: int,
    records: Sequence[Record],
    *,
    consumed: int | None = None,
    upsert: bool = False,
    partition: int = 0,
) -> Path:
    """A chunked segment of offsets first..last holding `records` (`consumed` records
    in the range: the rows' offsets and the dead-lettered ones)."""
    table = rows_of(records, upsert, partition)
    count = len({r.offset for r in records}) if consumed is None else consumed
    meta = {**MODEL, **CHUNKING, **segment_metadata(first, last, count, "tests")}
    table = table.replace_schema_metadata(meta)
    directory = vectors_dir(root)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / SegmentKey(TOPIC, partition, first).filename
    pq.write_table(table, path)
    return path


class FakeKafka:
    """A Scan over a fixed set of offsets that hold a record."""

    def __init__(self, records: Iterable[int]) -> None:
        self.records = np.array(sorted(records), dtype=np.int64)

    def __call__(self, key: tuple[str, int], ranges: Sequence[tuple[int, int]]):
        return self.records[within(self.records, ranges)], 0


def audit(root: Path, committed: int, dead: Iterable[int] = ()) -> PartitionAudit:
    """audit_partition of the output's partition 0, as `pipeline audit` calls it."""
    key = (TOPIC, 0)
    rows = read_output_rows(root, [TOPIC])
    return audit_partition(
        key,
        committed,
        0,
        10_000,
        rows.rows_of(key),
        np.array(sorted(dead), dtype=np.int64),
        rows.coverage(key, committed),
        FakeKafka(range(committed)),
        rows.purged_of(key),
        rows.chunk_rows.get(key),
        rows.bad_chunks_of(key),
        rows.chunk_problems.get(key, ()),
    )


def rendered(*audits: PartitionAudit) -> tuple[dict[str, Any], str]:
    report = audit_report("g", [TOPIC], Path("/o"), DeadLetters(f"{TOPIC}.dlq", True), audits, [])
    return report, render_audit(report)


def complete_output(root: Path) -> None:
    """Offsets 0..9 in two segments: records of 1 to 5 chunks, offset 4 dead-lettered."""
    write_chunked(root, 0, 4, [Record(0, 1), Record(1, 3), Record(2, 5), Record(3, 2)], consumed=5)
    write_chunked(root, 5, 9, [Record(o, 1 + o % 4) for o in range(5, 10)])


# --------------------------------------------------------------------------- audit


def test_the_audit_of_a_complete_chunked_output_counts_records_once(tmp_path: Path) -> None:
    complete_output(tmp_path)
    result = audit(tmp_path, 10, dead=[4])
    assert result.ok and result.missing == [] and result.doubled == []
    assert (result.rows, result.dead_lettered, result.chunk_rows) == (9, 1, 23)
    assert result.chunked and result.bad_chunks == [] and result.chunk_problems == []
    report, text = rendered(result)
    assert report["ok"] and report["totals"]["chunk_rows"] == 23
    assert report["totals"]["bad_chunks"] == 0 and report["partitions"][0]["chunked"]
    header = text.splitlines()[0].split()
    assert header[-2:] == ["CHUNKS", "BAD_CHUNKS"]
    assert text.splitlines()[1].split()[3] == "9"  # ROWS: records
    assert text.splitlines()[-1].startswith("audit OK")
    assert "9 records in 23 chunk rows, 0 with chunks incomplete or doubled" in text


@pytest.mark.parametrize(
    ("broken", "problem"),
    [
        (Record(2, rows=[(0, 3), (2, 3)]), "chunk 1 of 3 missing"),
        (Record(2, rows=[(0, 3), (1, 3), (1, 3), (2, 3)]), "chunk 1 more than once"),
        (Record(2, rows=[(0, 3), (1, 3), (2, 4)]), "chunk_count 3 and 4"),
        (Record(2, rows=[(0, 2), (1, 2), (2, 2)]), "chunk 2 past chunk_count 2"),
        (Record(2, rows=[(1, 2)]), "chunk 0 of 2 missing"),
    ],
)
def test_the_audit_fails_naming_a_record_whose_chunks_are_not_complete(
    tmp_path: Path, broken: Record, problem: str
) -> None:
    write_chunked(tmp_path, 0, 4, [Record(0, 2), Record(1, 3), broken, Record(3), Record(4, 4)])
    result = audit(tmp_path, 5)
    assert not result.ok and result.bad_chunks == [(2, 2)]
    assert result.missing == [] and result.doubled == []  # the record is there, once
    assert [(p.offset, p.problem) for p in result.chunk_problems] == [(2, problem)]
    report, text = rendered(result)
    assert not report["ok"] and report["totals"]["bad_chunks"] == 1
    assert report["partitions"][0]["chunk_problems"] == [{"offset": 2, "problem": problem}]
    assert f"chunks: {TOPIC}[0] offset 2: {problem}" in text
    assert text.splitlines()[1].split()[-1] == "2"  # BAD_CHUNKS
    assert text.splitlines()[-1].startswith("audit FAILED")


def test_a_record_split_across_two_segments_is_broken_in_both_and_doubled(
    tmp_path: Path,
) -> None:
    write_chunked(tmp_path, 0, 2, [Record(0, 2), Record(1), Record(2, rows=[(0, 3), (1, 3)])])
    write_chunked(tmp_path, 3, 4, [Record(2, rows=[(2, 3)]), Record(3), Record(4)], consumed=2)
    result = audit(tmp_path, 5)
    assert result.bad_chunks == [(2, 2)] and result.doubled == [(2, 2)] and not result.ok
    assert len(result.chunk_problems) == 2  # one per segment


def test_a_record_in_two_segments_whole_in_each_is_doubled(tmp_path: Path) -> None:
    write_chunked(tmp_path, 0, 1, [Record(0, 2), Record(1, 3)])
    write_chunked(tmp_path, 2, 3, [Record(1, 3), Record(2), Record(3)], consumed=2)
    result = audit(tmp_path, 4)
    assert result.doubled == [(1, 1)] and result.bad_chunks == [] and not result.ok


def test_bad_chunk_offsets_finds_every_broken_record_in_any_row_order() -> None:
    rng = np.random.default_rng(0)
    offsets, chunks, counts, broken = [], [], [], set()
    for offset in range(200):
        n = int(rng.integers(1, 6))
        pairs = [(c, n) for c in range(n)]
        kind = rng.integers(0, 8)
        if kind == 0 and n > 1:
            pairs.pop(int(rng.integers(0, n)))
        elif kind == 1:
            pairs.append(pairs[int(rng.integers(0, n))])
        elif kind == 2:
            pairs[-1] = (pairs[-1][0], n + 1)
        else:
            kind = -1
        if kind >= 0:
            broken.add(offset)
        for chunk, count in pairs:
            offsets.append(offset)
            chunks.append(chunk)
            counts.append(count)
    order = rng.permutation(len(offsets))
    found = bad_chunk_offsets(
        *(np.array(a, dtype=np.int64)[order] for a in (offsets, chunks, counts))
    )
    assert found.tolist() == sorted(broken)


def test_a_plain_outputs_audit_says_nothing_of_chunks(tmp_path: Path) -> None:
    from tests.helpers import write_segment

    write_segment(tmp_path, TOPIC, 0, 0, 4)
    result = audit(tmp_path, 5)
    assert result.ok and not result.chunked and result.rows == 5
    report, text = rendered(result)
    assert "chunked" not in report["partitions"][0] and "chunk_rows" not in report["totals"]
    assert "CHUNKS" not in text and "5 rows, " in text.splitlines()[-1]


# --------------------------------------------------------------------------- status


def test_status_compares_the_index_with_rows_not_records(tmp_path: Path) -> None:
    complete_output(tmp_path)
    coverage = output_coverage(tmp_path, {(TOPIC, 0): 10})[(TOPIC, 0)]
    assert coverage.ok and coverage.rows == 23  # one vector per row: the index's count
    assert PartitionOutput(coverage, index_entries=23).mismatch() is None
    fields = PartitionOutput(coverage, index_entries=23).fields()
    assert fields["rows"] == 23 and fields["chunked"] and fields["mismatch"] is None
    assert "index has 9 entries for 23 rows" in (PartitionOutput(coverage, 9).mismatch() or "")
    info = read_info(next(iter(iter_segments(tmp_path))))
    assert info.chunked and info.dead_lettered is None  # rows are chunks, not records


# --------------------------------------------------------------------------- compaction


def segment_rows(root: Path) -> list[tuple[int, int, int]]:
    """(offset, chunk, chunk_count) of every row, file by file in name order."""
    found = []
    for segment in sorted(iter_segments(root), key=lambda s: s.key.first):
        table = pq.read_table(segment.path, columns=["offset", CHUNK, CHUNK_COUNT])
        found += zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True)
    return found


def test_compaction_keeps_a_records_chunks_together_and_in_order(tmp_path: Path) -> None:
    complete_output(tmp_path)
    # A segment whose records' rows are out of chunk order (another writer's): sorted.
    shuffled = [Record(10, rows=[(2, 3), (0, 3), (1, 3)]), Record(11, 2), Record(12, 4)]
    table = rows_of(shuffled, upsert=False)
    write_chunked(tmp_path, 10, 12, shuffled)
    rows_before = sorted(segment_rows(tmp_path))
    texts_before = sorted(
        (o, c, t)
        for s in iter_segments(tmp_path)
        for o, c, t in zip(
            *(pq.read_table(s.path).column(n).to_pylist() for n in ("offset", CHUNK, "text")),
            strict=True,
        )
    )
    report = compact(tmp_path, target_bytes=64 << 20)
    (segment,) = iter_segments(tmp_path)
    assert report.merged_files == 3 and report.rows == 23 + table.num_rows
    assert segment_rows(tmp_path) == rows_before  # (offset, chunk) order
    merged = pq.read_table(segment.path)
    assert (
        sorted(zip(*(merged.column(n).to_pylist() for n in ("offset", CHUNK, "text")), strict=True))
        == texts_before
    )
    info = read_info(segment)
    assert (info.first, info.last, info.records, info.chunked) == (0, 12, 13, True)
    assert merged.schema.metadata[b"chunking.tokens"] == b"16"
    result = audit(tmp_path, 13, dead=[4])
    assert result.ok and result.rows == 12 and result.chunk_rows == 23 + 9


def test_compaction_never_merges_chunked_segments_with_plain_ones(tmp_path: Path) -> None:
    from tests.helpers import write_segment

    write_segment(tmp_path, TOPIC, 0, 0, 1)
    write_chunked(tmp_path, 2, 3, [Record(2, 2), Record(3, 3)])
    write_chunked(tmp_path, 4, 5, [Record(4, 2), Record(5)])
    report = compact(tmp_path, target_bytes=64 << 20)
    assert report.runs == 1 and report.merged_files == 2
    assert [(s.key.first, s.named_last) for s in segments_by_partition(tmp_path)[(TOPIC, 0)]] == [
        (0, None),
        (2, 5),
    ]


def test_an_erasure_takes_every_chunk_row_of_a_record(tmp_path: Path) -> None:
    write_chunked(tmp_path, 0, 2, [Record(0, 3), Record(1, 2), Record(2, 4)])
    write_chunked(tmp_path, 3, 4, [Record(3, 5), Record(4, 1)])
    keep = {(TOPIC, 0): np.array([1, 4], dtype=np.int64)}
    report = compact(tmp_path, 64 << 20, erase=Erasure({(TOPIC, 0): 4}, keep))
    assert report.erased == 3 + 4 + 5
    assert segment_rows(tmp_path) == [(1, 0, 2), (1, 1, 2), (4, 0, 1)]
    (segment,) = iter_segments(tmp_path)
    assert read_info(segment).purged == ((0, 0), (2, 3))
    result = audit(tmp_path, 5)
    assert result.ok and (result.rows, result.purged, result.chunk_rows) == (2, 3, 3)


# --------------------------------------------------------------------------- the view


class Removals:
    """Stands for the index: records what the view stops serving."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[tuple[str, int, int]], list[int] | None]] = []

    def remove(self, places, chunk_counts=None) -> int:
        self.calls.append((list(places), None if chunk_counts is None else list(chunk_counts)))
        return len(self.calls[-1][0])

    def removed(self) -> list[tuple[int, int]]:
        """(offset, chunk count) of every version removed so far."""
        found = []
        for places, counts in self.calls:
            found += [
                (o, c) for (_, _, o), c in zip(places, counts or [1] * len(places), strict=True)
            ]
        return sorted(found)


class ChunkedUpserts:
    """An upsert-mode chunked output, one segment per `write`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.next = 0

    def write(self, *changes: tuple[str, int | None]) -> list[int]:
        """(document, chunks) pairs; chunks None deletes the document. Their offsets."""
        first = self.next
        records = [
            Record(first + i, chunks or 1, doc=doc, deleted=chunks is None)
            for i, (doc, chunks) in enumerate(changes)
        ]
        write_chunked(self.root, first, first + len(records) - 1, records, upsert=True)
        self.next += len(records)
        return [r.offset for r in records]

    def view(self) -> dict[str, list[tuple[int, int, int]]]:
        """Per document, its rows in the view: (offset, chunk, chunk_count), sorted."""
        rows = lance.dataset(str(self.root / "current")).to_table().to_pylist()
        found: dict[str, list[tuple[int, int, int]]] = {}
        for row in rows:
            found.setdefault(row[DOC_KEY], []).append((row["offset"], row[CHUNK], row[CHUNK_COUNT]))
        return {k: sorted(v) for k, v in found.items()}


def chunks_of(offset: int, count: int) -> list[tuple[int, int, int]]:
    return [(offset, c, count) for c in range(count)]


def test_the_view_holds_every_chunk_of_each_documents_latest_version(tmp_path: Path) -> None:
    out = ChunkedUpserts(tmp_path)
    index = Removals()
    view = ViewStore(tmp_path, index=index)  # type: ignore[arg-type]
    dataset = lambda: lance.dataset(str(tmp_path / "current"))  # noqa: E731

    (a0, b0) = out.write(("a", 3), ("b", 2))
    assert view.sync() == 5
    assert out.view() == {"a": chunks_of(a0, 3), "b": chunks_of(b0, 2)}
    text = {r[CHUNK]: r["text"] for r in dataset().to_table().to_pylist() if r[DOC_KEY] == "a"}
    assert sorted(text) == [0, 1, 2] and all(text.values())

    # 3 chunks -> 1: the two extra chunks of the old version go with it.
    (a1,) = out.write(("a", 1))
    version = dataset().version
    view.sync()
    assert dataset().version == version + 1  # one commit
    assert out.view() == {"a": chunks_of(a1, 1), "b": chunks_of(b0, 2)}
    assert index.removed() == [(a0, 3)]

    # 1 chunk -> 5, and b replaced twice in one apply (its middle version never live).
    (a2, b1, b2) = out.write(("a", 5), ("b", 4), ("b", 3))
    view.sync()
    assert out.view() == {"a": chunks_of(a2, 5), "b": chunks_of(b2, 3)}
    assert index.removed() == sorted([(a0, 3), (b0, 2), (a1, 1), (b1, 4)])

    # A delete removes every chunk.
    (a3,) = out.write(("a", None))
    view.sync()
    assert out.view() == {"b": chunks_of(b2, 3)}
    assert index.removed() == sorted([(a0, 3), (b0, 2), (a1, 1), (b1, 4), (a2, 5)])
    assert view.positions() == {f"{TOPIC}:0": a3}
    assert view.sync() == 0  # caught up: nothing applied twice

    # The audit of the history is clean, and a purge keeps b's latest version only.
    assert audit(tmp_path, out.next).ok
    through, keep = view.snapshot()
    assert {k: v.tolist() for k, v in keep.items()} == {(TOPIC, 0): [b2]}
    compact(tmp_path, 64 << 20, erase=Erasure(through, keep))
    assert segment_rows(tmp_path) == chunks_of(b2, 3)
    result = audit(tmp_path, out.next)
    assert result.ok and result.purged == out.next - 1 and result.rows == 1


def test_a_document_back_after_a_delete_and_many_documents_in_one_apply(tmp_path: Path) -> None:
    out = ChunkedUpserts(tmp_path)
    rng = np.random.default_rng(11)
    view = ViewStore(tmp_path)
    expected: dict[str, tuple[int, int]] = {}
    for _ in range(8):
        changes = [
            (f"k{rng.integers(6)}", None if rng.random() < 0.25 else int(rng.integers(1, 6)))
            for _ in range(int(rng.integers(1, 8)))
        ]
        for (doc, chunks), offset in zip(changes, out.write(*changes), strict=True):
            if chunks is None:
                expected.pop(doc, None)
            else:
                expected[doc] = (offset, chunks)
        view.sync()
        assert out.view() == {doc: chunks_of(o, n) for doc, (o, n) in expected.items()}


def test_an_apply_in_parts_never_cuts_a_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sinks import view as view_module

    out = ChunkedUpserts(tmp_path)
    changes = [(f"k{i % 7}", 1 + i % 5) for i in range(60)]
    offsets = out.write(*changes)  # one segment of 180 rows
    monkeypatch.setattr(view_module, "MAX_APPLY_BYTES", 2048)
    view = ViewStore(tmp_path)
    view.sync()
    assert view.last_sync.commits > 3
    latest = {doc: (o, n) for (doc, n), o in zip(changes, offsets, strict=True)}
    assert out.view() == {doc: chunks_of(o, n) for doc, (o, n) in latest.items()}
    assert view.positions() == {f"{TOPIC}:0": offsets[-1]}


def test_a_chunked_key_at_the_same_offset_in_two_partitions_is_replaced(tmp_path: Path) -> None:
    """The merge tells a version's rows apart by partition too: partitions count offsets
    from 0 each, so a document's versions may share an offset and chunk numbers."""
    view = ViewStore(tmp_path)
    write_chunked(tmp_path, 0, 0, [Record(0, 3, doc="a")], upsert=True, partition=0)
    view.sync()
    # Equal timestamps: the larger partition wins (sinks.view_plan.newer).
    write_chunked(tmp_path, 0, 0, [Record(0, 2, doc="a")], upsert=True, partition=1)
    view.sync()  # raised "Ambiguous merge inserts" when merging on (doc_key, offset, chunk)
    rows = lance.dataset(str(tmp_path / "current")).to_table().to_pylist()
    assert sorted((r["partition"], r["offset"], r[CHUNK], r[CHUNK_COUNT]) for r in rows) == [
        (1, 0, 0, 2), (1, 0, 1, 2),
    ]  # fmt: skip


def test_record_end_cuts_between_records_only() -> None:
    offsets = np.array([0, 1, 1, 1, 2, 3, 3], dtype=np.int64)
    assert [_record_end(offsets, room) for room in range(1, 8)] == [1, 1, 1, 4, 5, 5, 7]
    assert _record_end(np.array([5, 5, 5, 6]), 1) == 3  # the first record whole at least
    assert _record_end(np.array([], dtype=np.int64), 0) == 0


def test_the_plan_takes_a_records_rows_together() -> None:
    rows = rows_of(
        [Record(0, 3, doc="a"), Record(1, 2, doc="b"), Record(2, 4, doc="a")], upsert=True
    )
    live = {"b": {"topic": TOPIC, "partition": 0, "offset": -1, "timestamp": 0,
                  CHUNK_COUNT: 6, "chunks": [0, 1, 2, 3, 4, 5]}}  # fmt: skip
    change = plan(rows, live)
    assert change.upserts.column("offset").to_pylist() == [1, 1, 2, 2, 2, 2]
    assert change.upserts.column(CHUNK).to_pylist() == [0, 1, 0, 1, 2, 3]
    assert sorted(zip(change.removed, change.removed_counts or [], strict=True)) == [
        ((TOPIC, 0, -1), 6),
        ((TOPIC, 0, 0), 3),
    ]
    assert [(r["offset"], r[CHUNK]) for r in change.replaced] == [(-1, c) for c in range(6)]
    assert change.documents == 2


# --------------------------------------------------------------------------- the chaos check


@pytest.fixture
def chaos() -> Any:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from chaos import check, upsert

    return check, upsert


def test_the_chaos_check_reads_a_chunked_record_as_one_row(tmp_path: Path, chaos: Any) -> None:
    check, _ = chaos
    import json
    from collections import Counter

    broken = Record(2, rows=[(0, 2)], text=Record(2, 2).whole)
    write_chunked(tmp_path, 0, 3, [Record(0, 3), Record(1), broken], consumed=4)
    scan = check.parquet_rows(tmp_path, TOPIC)
    assert [(p, o) for p, o, _ in scan.rows] == [(0, 0), (0, 1), (0, 2)] and not scan.bad_vectors
    real = {(0, o): json.dumps({"text": Record(o, n).whole}).encode() for o, n in [(0, 3), (1, 1)]}
    real[(0, 2)] = json.dumps({"text": broken.whole}).encode()
    real[(0, 3)] = b"{not json"
    verdict = check.check_records(real, scan.rows, Counter({(0, 3): 1}))
    assert verdict.mismatched == [(0, 2)]  # chunk 1 of 2 missing
    assert not (verdict.lost or verdict.doubled or verdict.phantom or verdict.misrouted)
    ids = Counter([(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 2, 0)])
    check.check_index(verdict, scan.rows, ids)
    assert verdict.index == {"missing": 0, "doubled": 0, "extra": 0}
    check.check_index(verdict, scan.rows, ids - Counter([(0, 0, 1)]))
    assert verdict.index["missing"] == 1


def test_chunked_text_equals_the_text_its_chunks_cover(chaos: Any) -> None:
    check, _ = chaos
    text = "alpha beta gamma delta"
    chunks = check.ChunkedText(
        [(1, 2, 11, 22, "gamma delta", False), (0, 2, 0, 10, "alpha beta", False)]
    )
    assert chunks == text and (chunks != text) is False and chunks.chunks == [0, 1]
    assert chunks != "alpha beta gamma delta!"  # past the last chunk, not truncated
    assert chunks != "alpha betaXgamma delta"  # a gap that is not whitespace
    cut = check.ChunkedText([(0, 1, 0, 10, "alpha beta", True)])
    assert cut == text  # truncated: the rest was never embedded
    assert check.ChunkedText([(0, 2, 0, 10, "alpha beta", True)]) != text  # incomplete


def test_the_chaos_check_of_a_chunked_view(tmp_path: Path, chaos: Any) -> None:
    _, upsert = chaos
    out = ChunkedUpserts(tmp_path)
    (a0, b0) = out.write(("a", 3), ("b", 2))
    ViewStore(tmp_path).sync()
    (a1,) = out.write(("a", 5))
    ViewStore(tmp_path).sync()
    text = {o: Record(o, n).whole for o, n in [(a1, 5), (b0, 2)]}
    want = upsert.Expected(
        {},
        {
            "a": upsert.Version(0, a1, a1, upsert.GOOD, text[a1]),
            "b": upsert.Version(0, b0, b0, upsert.GOOD, text[b0]),
        },
    )
    docs = upsert.DocumentVerdict()
    upsert.check_view(docs, want, upsert.view_rows(tmp_path), TOPIC)
    assert docs.view_rows == 7 and docs.clean, docs.problems()
    stale = upsert.Expected({}, {**want.latest, "a": upsert.Version(0, a0, a0, upsert.GOOD, "x")})
    docs = upsert.DocumentVerdict()
    upsert.check_view(docs, stale, upsert.view_rows(tmp_path), TOPIC)
    assert docs.view_stale == ["a"] and not docs.view_doubled
