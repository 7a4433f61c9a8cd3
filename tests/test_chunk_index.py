"""The index of an output of chunks (issue 35): ids per (topic, partition, offset,
chunk) in the chunked layout, sync adding every chunk row once, search returning
documents (the best chunk of each record, with its span) or chunks (`--chunks`),
`pipeline index check` comparing rows per (offset, chunk), removals of every chunk
of a record; plain outputs unchanged. Segments are written by hand, no broker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.core.chunks import CHUNKED, PLAIN
from pipeline.core.errors import IndexStateError
from pipeline.core.layout import INDEX_META_FILE, SegmentKey, index_dir, vectors_dir
from pipeline.core.model_info import ModelInfo
from pipeline.search import Found, find
from sinks.index.check import check_index
from sinks.index.ids import CHUNKED_IDS, PLAIN_IDS, ChunksInPlainIndex, decode_id, encode_id
from sinks.index.shards import IndexMeta
from sinks.index.store import IndexStore
from sinks.parquet import schema
from sinks.segments import segment_metadata

DIM = 16
Place = tuple[str, int, int]  # (topic, partition, offset)
Row = tuple[str, int, int, int]  # with the chunk


def model_metadata() -> dict[str, str]:
    info = ModelInfo(
        "test-model", "/m", "sha256:feedfacefeedface", DIM, "mean", True, 256, "fp32", "cpu",
        similarity="cosine",
    )  # fmt: skip
    return {f"embedding.{k}": v for k, v in info.as_metadata().items()}


def unit(v: np.ndarray) -> np.ndarray:
    return (v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12)).astype(np.float32)


class Output:
    """An output directory of segments as a worker writes them: with `chunked`, each
    record is `chunk_count` rows (chunk, chunk_count, char_start, char_end, truncated,
    tokens after `embedding`), all in one segment; footers count records."""

    def __init__(self, root: Path, chunked: bool = True) -> None:
        self.root = root
        self.chunked = chunked
        self.vectors: dict[Row, np.ndarray] = {}
        self.spans: dict[Row, tuple[int, int, str]] = {}  # char_start, char_end, text
        self._rng = np.random.default_rng(35)

    def segment(
        self,
        topic: str,
        partition: int,
        first: int,
        last: int,
        chunks: dict[int, int] | None = None,
        vectors: dict[Row, np.ndarray] | None = None,
        drop: tuple[Row, ...] = (),
        docs: dict[int, str] | None = None,
        tombstones: tuple[int, ...] = (),
    ) -> int:
        """Writes a segment of offsets first..last, `chunks[offset]` chunks each (default
        1 + offset % 4); `vectors` gives some rows' vectors; `drop`: rows left out (a
        damaged write); `docs` (upsert mode): each offset's document key, `tombstones`
        the offsets that delete theirs. Returns its rows."""
        chunks = chunks or {}
        names = [*_COLUMNS[:9], *(_UPSERT if docs is not None else []), *_COLUMNS[9:]]
        columns: dict[str, list[Any]] = {c: [] for c in names}
        for offset in range(first, last + 1):
            count = chunks.get(offset, 1 + offset % 4) if self.chunked else 1
            key = None if docs is None else docs[offset]
            deleted = offset in tombstones
            if deleted:  # a deletion: one row, no vector
                count = 1
            record_text = " ".join(f"w{offset}.{i}" for i in range(40 * count))
            step = max(1, len(record_text) // count)
            for chunk in range(count):
                row = (topic, partition, offset, chunk)
                start = chunk * step
                end = (
                    len(record_text)
                    if chunk == count - 1
                    else min(len(record_text), start + step + 7)
                )
                vector = (vectors or {}).get(row)
                vector = unit(self._rng.standard_normal(DIM)) if vector is None else unit(vector)
                if deleted:
                    vector, start, end, record_text = np.zeros(DIM, np.float32), 0, 0, ""
                else:
                    self.vectors[row] = vector
                    self.spans[row] = (start, end, record_text[start:end])
                if row in drop:
                    continue
                values = {
                    "topic": topic, "partition": partition, "offset": offset,
                    "key": f"k{offset}".encode(), "id": f"id-{offset}",
                    "text": record_text[start:end], "timestamp": 1000 + offset, "metadata": None,
                    "embedding": vector.tolist(), "chunk": chunk, "chunk_count": count,
                    "char_start": start, "char_end": end, "truncated": False, "tokens": 12,
                    "doc_key": key, "deleted": deleted,
                }  # fmt: skip
                for name in columns:
                    columns[name].append(values[name])
        schema = _schema(self.chunked, upsert=docs is not None)
        meta = {
            **model_metadata(),
            **segment_metadata(first, last, last - first + 1, "tests"),
            **({"chunking.tokens": "64", "chunking.overlap": "8"} if self.chunked else {}),
        }
        table = pa.Table.from_pydict(
            {f.name: columns[f.name] for f in schema}, schema=schema.with_metadata(meta)
        )
        directory = vectors_dir(self.root)
        directory.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, directory / SegmentKey(topic, partition, first).filename)
        return table.num_rows

    def rows(self) -> set[Row]:
        return set(self.vectors)


_COLUMNS = [
    "topic", "partition", "offset", "key", "id", "text", "timestamp", "metadata", "embedding",
    "chunk", "chunk_count", "char_start", "char_end", "truncated", "tokens",
]  # fmt: skip


_UPSERT = ["doc_key", "deleted"]


def _schema(chunked: bool, upsert: bool = False) -> pa.Schema:
    """The segment columns the worker writes (sinks.parquet), chunked or the plain ones
    of an output made before rows said what was cut."""
    return schema(DIM, upsert=upsert, rows=CHUNKED if chunked else PLAIN)


def index_rows(store: IndexStore) -> list[Row]:
    """(topic, partition, offset, chunk) of every id the store's index serves."""
    meta = store.saved_meta()
    assert meta is not None
    topics = {no: name for name, no in meta.topics.items()}
    out = []
    for vector_id in store.ids().tolist():
        topic_no, partition, offset, chunk = meta.layout.decode(vector_id)
        out.append((topics[topic_no], partition, offset, chunk))
    return out


def meta_json(root: Path) -> dict[str, Any]:
    return json.loads((index_dir(root) / INDEX_META_FILE).read_text())


def loaded(root: Path) -> IndexStore:
    store = IndexStore(root)
    store.load()
    return store


@pytest.fixture
def out(tmp_path: Path) -> Output:
    return Output(tmp_path)


# ------------------------------------------------------------------ ids


@pytest.mark.parametrize(
    ("topic_no", "partition", "offset", "chunk"),
    [(0, 0, 0, 0), (1, 2, 3, 4), (127, 4095, (1 << 36) - 1, 255), (5, 17, 123_456_789, 200)],
)
def test_chunked_ids_round_trip(topic_no: int, partition: int, offset: int, chunk: int) -> None:
    vector_id = CHUNKED_IDS.encode(topic_no, partition, offset, chunk)
    assert 0 <= vector_id < 1 << 63  # a FAISS id is a signed int64
    assert CHUNKED_IDS.decode(vector_id) == (topic_no, partition, offset, chunk)
    many = CHUNKED_IDS.encode_many(topic_no, partition, np.array([offset]), np.array([chunk]))
    assert many.dtype == np.int64 and many.tolist() == [vector_id]
    assert [int(a[0]) for a in CHUNKED_IDS.decode_many(many)] == [
        topic_no, partition, offset, chunk,
    ]  # fmt: skip
    assert CHUNKED_IDS.base(topic_no, partition) | (offset << 8) | chunk == vector_id


def test_chunked_ids_are_distinct_for_distinct_rows() -> None:
    rows = [
        (t, p, o, c)
        for t in (0, 1, 127)
        for p in (0, 1, 4095)
        for o in (0, 1, 255, 256, (1 << 36) - 1)
        for c in (0, 1, 255)
    ]
    ids = [CHUNKED_IDS.encode(*r) for r in rows]
    assert len(set(ids)) == len(rows)
    topics, partitions, offsets, chunks = (np.array(c) for c in zip(*rows, strict=True))
    assert CHUNKED_IDS.encode_many(topics, partitions, offsets, chunks).tolist() == ids


@pytest.mark.parametrize(
    ("topic_no", "partition", "offset", "chunk"),
    [
        (128, 0, 0, 0),
        (-1, 0, 0, 0),
        (0, 4096, 0, 0),
        (0, -1, 0, 0),
        (0, 0, 1 << 36, 0),
        (0, 0, -1, 0),
        (0, 0, 0, 256),
        (0, 0, 0, -1),
    ],
)
def test_chunked_ids_out_of_bounds_are_refused(
    topic_no: int, partition: int, offset: int, chunk: int
) -> None:
    with pytest.raises(IndexStateError):
        CHUNKED_IDS.encode(topic_no, partition, offset, chunk)
    with pytest.raises(IndexStateError):
        CHUNKED_IDS.encode_many(topic_no, partition, np.array([0, offset]), np.array([0, chunk]))


def test_plain_ids_unchanged_and_refuse_chunks() -> None:
    assert encode_id(3, 7, 11) == (3 << 56) | (7 << 40) | 11 == PLAIN_IDS.encode(3, 7, 11)
    assert decode_id(encode_id(3, 7, 11)) == (3, 7, 11)
    assert PLAIN_IDS.decode(encode_id(3, 7, 11)) == (3, 7, 11, 0)
    with pytest.raises(ChunksInPlainIndex):
        PLAIN_IDS.encode(0, 0, 5, 1)
    with pytest.raises(IndexStateError):
        PLAIN_IDS.encode_many(0, 0, np.array([1, 2]), np.array([0, 1]))


def test_index_json_without_chunks_is_plain() -> None:
    meta = IndexMeta.from_json(json.dumps({"dim": 4, "entries": {}}))
    assert not meta.chunks and meta.layout is PLAIN_IDS
    again = IndexMeta.from_json(IndexMeta(dim=4, chunks=True).to_json())
    assert again.chunks and again.layout is CHUNKED_IDS


# ------------------------------------------------------------------ sync


def test_sync_adds_every_chunk_row_once(out: Output) -> None:
    rows = out.segment("t", 0, 0, 9) + out.segment("t", 1, 0, 5, chunks={3: 12})
    store = IndexStore(out.root)
    assert store.sync() == rows
    assert meta_json(out.root)["chunks"] is True
    found = index_rows(store)
    assert len(found) == len(set(found)) == rows
    assert set(found) == out.rows()
    assert store.sync() == 0  # nothing new
    rows = out.segment("t", 0, 10, 14, chunks={12: 30})
    assert IndexStore(out.root).sync() == rows
    found = index_rows(store)
    assert len(found) == len(set(found)) and set(found) == out.rows()
    meta = store.saved_meta()
    assert meta is not None and meta.count == len(out.rows())
    assert check_index(out.root).ok


def test_rebuild_of_a_chunked_output_equals_the_sync(out: Output) -> None:
    out.segment("t", 0, 0, 9)
    out.segment("u", 2, 0, 4)
    IndexStore(out.root).sync()
    synced = sorted(IndexStore(out.root).ids().tolist())
    rebuilt = IndexStore(out.root)
    assert rebuilt.rebuild() == len(out.rows())
    assert sorted(rebuilt.ids().tolist()) == synced
    assert meta_json(out.root)["chunks"] is True


def test_a_plain_index_meeting_chunks_is_refused_and_a_rebuild_makes_it_chunked(
    tmp_path: Path,
) -> None:
    plain = Output(tmp_path, chunked=False)
    plain.segment("t", 0, 0, 4)
    assert IndexStore(tmp_path).sync() == 5
    assert meta_json(tmp_path)["chunks"] is False
    chunked = Output(tmp_path)
    chunked.segment("t", 0, 5, 9)
    with pytest.raises(IndexStateError, match="rebuild"):
        IndexStore(tmp_path).sync()
    store = IndexStore(tmp_path)
    assert store.rebuild() == 5 + len(chunked.rows())
    assert meta_json(tmp_path)["chunks"] is True
    assert set(index_rows(store)) == plain.rows() | chunked.rows()
    assert check_index(tmp_path).ok


# ------------------------------------------------------------------ search


def _close_to(vector: np.ndarray, rng: np.random.Generator, noise: float) -> np.ndarray:
    return unit(vector + noise * rng.standard_normal(DIM).astype(np.float32))


def test_search_returns_the_document_of_a_deep_chunk_with_its_span(out: Output) -> None:
    out.segment("t", 0, 0, 19, chunks={7: 10})
    IndexStore(out.root).sync()
    deep = ("t", 0, 7, 8)
    hits = find(out.root, loaded(out.root), out.vectors[deep][None, :], k=5)
    assert len(hits) == 5
    assert len({(h["topic"], h["partition"], h["offset"]) for h in hits}) == 5  # documents
    best = hits[0]
    start, end, text = out.spans[deep]
    assert (best["offset"], best["chunk"], best["chunk_count"]) == (7, 8, 10)
    assert (best["char_start"], best["char_end"], best["text"]) == (start, end, text)
    assert best["score"] == pytest.approx(1.0, abs=1e-5)
    assert best["id"] == "id-7" and best["key"] == "k7"
    for hit in hits:  # each hit's row is its chunk's
        row = (hit["topic"], hit["partition"], hit["offset"], hit["chunk"])
        assert hit["text"] == out.spans[row][2]
        assert hit["score"] == pytest.approx(float(out.vectors[row] @ out.vectors[deep]), abs=1e-5)
    scores = [h["score"] for h in hits]
    assert scores == sorted(scores, reverse=True)


def test_search_fetches_more_until_k_documents(out: Output) -> None:
    """One record's 40 chunks all outrank every other row: k documents still come back."""
    rng = np.random.default_rng(3)
    query = unit(rng.standard_normal(DIM).astype(np.float32))
    near = {("t", 0, 4, c): _close_to(query, rng, 0.01) for c in range(40)}
    near[("t", 0, 9, 0)] = _close_to(query, rng, 0.1)  # the second document
    out.segment("t", 0, 0, 29, chunks={4: 40}, vectors=near)
    IndexStore(out.root).sync()
    store = loaded(out.root)
    hits = find(out.root, store, query[None, :], k=6)
    assert [h["offset"] for h in hits][:2] == [4, 9]
    assert len({h["offset"] for h in hits}) == 6
    chunk_hits = find(out.root, store, query[None, :], k=6, chunks=True)
    assert [h["offset"] for h in chunk_hits] == [4] * 6  # --chunks: chunk rows ungrouped
    assert len({h["chunk"] for h in chunk_hits}) == 6
    for hit in chunk_hits:
        assert hit["text"] == out.spans[("t", 0, 4, hit["chunk"])][2]
        assert hit["chunk_count"] == 40
    everything = find(out.root, store, query[None, :], k=1000)
    assert len(everything) == 30  # every document once, whatever k asks


def test_search_of_a_plain_output_is_unchanged(tmp_path: Path) -> None:
    plain = Output(tmp_path, chunked=False)
    plain.segment("t", 0, 0, 9)
    store = IndexStore(tmp_path)
    store.sync()
    meta = meta_json(tmp_path)
    assert meta["chunks"] is False
    expected = sorted(encode_id(meta["topics"]["t"], 0, o) for o in range(10))
    assert sorted(store.ids().tolist()) == expected
    query = plain.vectors[("t", 0, 6, 0)]
    hits = find(tmp_path, loaded(tmp_path), query[None, :], k=3)
    assert hits[0]["offset"] == 6 and len(hits) == 3
    assert set(hits[0]) == {"topic", "partition", "offset", "id", "text", "key", "timestamp",
                            "score"}  # fmt: skip
    assert loaded(tmp_path).search(query[None, :], 1)[0][0].chunk == 0
    assert check_index(tmp_path).ok


def test_upsert_search_groups_live_chunks(out: Output, monkeypatch: pytest.MonkeyPatch) -> None:
    """In upsert mode a record is live where the view holds it; its hits are grouped
    and each row is its chunk's: from the view where it holds the chunk columns, else
    from the segments."""
    import pipeline.search as search_mod

    rng = np.random.default_rng(5)
    query = unit(rng.standard_normal(DIM).astype(np.float32))
    near = {("t", 0, 2, c): _close_to(query, rng, 0.02) for c in range(6)}  # superseded
    near |= {("t", 0, 8, c): _close_to(query, rng, 0.05) for c in range(5)}
    out.segment("t", 0, 0, 11, chunks={2: 6, 8: 5}, vectors=near)
    IndexStore(out.root).sync()
    live_offsets = set(range(12)) - {2}
    table = pq.read_table(next(vectors_dir(out.root).glob("*.parquet")))
    table = table.append_column("doc_key", pa.array([f"d{o}" for o in table["offset"].to_pylist()]))

    class View:
        spans = True

        def __init__(self, output: Path) -> None:
            pass

        def dataset(self) -> Any:
            names = table.schema.names if View.spans else [*_COLUMNS[:9], "doc_key"]
            return type("D", (), {"schema": pa.schema([table.schema.field(n) for n in names])})

        def live(self, where: list[Place], columns: list[str]) -> pa.Table:
            rows = [
                r for r in table.select(columns).to_pylist()
                if (r["topic"], r["partition"], r["offset"]) in set(where)
                and r["offset"] in live_offsets and (View.spans or r.get("chunk", 0) == 0)
            ]  # fmt: skip
            return pa.Table.from_pylist(rows, schema=table.select(columns).schema)

    monkeypatch.setattr(search_mod, "ViewStore", View)
    monkeypatch.setattr(search_mod, "has_view", lambda output: True)
    for spans in (True, False):
        View.spans = spans
        hits = find(out.root, loaded(out.root), query[None, :], k=4)
        assert hits[0]["offset"] == 8 and 2 not in {h["offset"] for h in hits}
        assert len({h["offset"] for h in hits}) == 4
        for hit in hits:
            row = (hit["topic"], hit["partition"], hit["offset"], hit["chunk"])
            assert hit["text"] == out.spans[row][2]
            assert hit["doc_key"] == f"d{hit['offset']}"
            assert hit["char_start"] == out.spans[row][0]
        chunk_hits = find(out.root, loaded(out.root), query[None, :], k=4, chunks=True)
        assert [h["offset"] for h in chunk_hits] == [8] * 4


@pytest.mark.parametrize("chunked", [True, False])
def test_upsert_search_with_the_view(tmp_path: Path, chunked: bool) -> None:
    """Upsert mode with the real view: an update replaces every chunk of a document, a
    delete removes them all; search returns each live document once, its best chunk."""
    from sinks.view import ViewStore

    out = Output(tmp_path, chunked=chunked)
    rng = np.random.default_rng(9)
    query = unit(rng.standard_normal(DIM).astype(np.float32))
    near = {("t", 0, 1, c): _close_to(query, rng, 0.01) for c in range(5)}  # a, replaced
    near |= {("t", 0, 2, c): _close_to(query, rng, 0.02) for c in range(4)}  # b, deleted
    near |= {("t", 0, 4, c): _close_to(query, rng, 0.1) for c in range(2)}  # a's new version
    docs = {0: "z", 1: "a", 2: "b", 3: "c", 4: "a", 5: "b", 6: "d"}
    out.segment("t", 0, 0, 3, chunks={1: 5, 2: 4}, vectors=near, docs=docs)
    out.segment("t", 0, 4, 6, chunks={4: 2}, vectors=near, docs=docs, tombstones=(5,))
    view = ViewStore(tmp_path, index=IndexStore(tmp_path))
    view.sync()
    IndexStore(tmp_path).sync()
    judged = ViewStore(tmp_path).snapshot()
    assert check_index(tmp_path, judged=judged).ok
    hits = find(tmp_path, loaded(tmp_path), query[None, :], k=3)
    assert hits[0]["offset"] == 4 and hits[0]["doc_key"] == "a"
    assert {h["offset"] for h in hits}.isdisjoint({1, 2, 5})  # superseded, deleted
    assert len({h["offset"] for h in hits}) == 3
    for hit in hits:
        row = (hit["topic"], hit["partition"], hit["offset"], hit.get("chunk", 0))
        assert hit["text"] == out.spans[row][2]
    assert ("chunk" in hits[0]) == chunked


def test_search_command_prints_spans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    import pipeline.search as search_mod
    from pipeline import cli

    hit = {"topic": "t", "partition": 0, "offset": 7, "id": "id-7", "text": "deep text",
           "key": None, "timestamp": 1, "chunk": 2, "chunk_count": 12, "char_start": 4120,
           "char_end": 5033, "score": 0.5}  # fmt: skip
    asked: list[Any] = []

    def fake(output: Path, query: str, k: int, device: str, prompt: Any, chunks: bool) -> Found:
        asked.append(chunks)
        return Found("cosine", [hit])

    monkeypatch.setattr(search_mod, "search", fake)
    result = CliRunner().invoke(cli.main, ["search", "--output", str(tmp_path), "q"])
    assert result.exit_code == 0, result.output
    assert "t[0]@7  chunk 3/12 chars 4120-5033  id=id-7" in result.output
    args = ["search", "--output", str(tmp_path), "--json", "--chunks", "q"]
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert set(body) == {"query", "similarity", "hits"} and body["hits"] == [hit]
    assert asked == [False, True]


# ------------------------------------------------------------------ check


def test_index_check_compares_chunk_rows(out: Output) -> None:
    from click.testing import CliRunner

    from pipeline import cli

    out.segment("t", 0, 0, 9)
    out.segment("t", 0, 10, 14, chunks={12: 7})
    IndexStore(out.root).sync()
    report = check_index(out.root)
    assert report.ok and report.vectors == len(out.rows()) and report.uncovered_rows == 0
    assert check_index(out.root, recall=True).measured_recall_at_10 == pytest.approx(1.0)
    result = CliRunner().invoke(cli.main, ["index", "check", "--output", str(out.root)])
    assert result.exit_code == 0, result.output
    # One chunk's vector no longer in the index: missing, per (offset, chunk).
    IndexStore(out.root).remove_chunks([("t", 0, 12, 5)])
    report = check_index(out.root)
    assert (report.missing, report.extra, report.doubled) == (1, 0, 0) and not report.ok
    result = CliRunner().invoke(cli.main, ["index", "check", "--output", str(out.root)])
    assert result.exit_code == 65, result.output


def test_index_check_finds_a_chunk_row_the_index_lacks(out: Output) -> None:
    """A segment synced without one chunk row, then written again whole (as a repair
    would): the index lacks that chunk's vector, and the check says so."""
    out.segment("t", 0, 0, 9, chunks={4: 3}, drop=(("t", 0, 4, 1),))
    IndexStore(out.root).sync()
    assert check_index(out.root).ok
    out.segment("t", 0, 0, 9, chunks={4: 3})
    report = check_index(out.root)
    assert (report.missing, report.extra, report.doubled) == (1, 0, 0) and not report.ok


# ------------------------------------------------------------------ removals


def test_removal_of_every_chunk_of_a_record(out: Output) -> None:
    out.segment("t", 0, 0, 9, chunks={3: 5, 6: 2})
    store = IndexStore(out.root)
    store.sync()
    with pytest.raises(IndexStateError, match="chunk"):
        store.remove([("t", 0, 3)])  # a chunked index needs the chunk counts
    assert store.remove([("t", 0, 3), ("t", 0, 6)], chunk_counts=[5, 2]) == 2
    gone = {("t", 0, 3, c) for c in range(5)} | {("t", 0, 6, 0), ("t", 0, 6, 1)}
    assert set(index_rows(store)) == out.rows() - gone
    hits = find(out.root, loaded(out.root), out.vectors[("t", 0, 3, 4)][None, :], k=20)
    assert {3, 6}.isdisjoint(h["offset"] for h in hits)
    with pytest.raises(IndexStateError):
        store.remove([("t", 0, 1)], chunk_counts=[0])
    with pytest.raises(IndexStateError):
        store.remove([("t", 0, 1)], chunk_counts=[1, 2])


def test_removals_in_a_plain_index(tmp_path: Path) -> None:
    plain = Output(tmp_path, chunked=False)
    plain.segment("t", 0, 0, 9)
    store = IndexStore(tmp_path)
    store.sync()
    assert store.remove([("t", 0, 1)]) == 1
    assert store.remove([("t", 0, 2)], chunk_counts=[1]) == 1
    assert store.remove_chunks([("t", 0, 3, 0)]) == 1
    with pytest.raises(IndexStateError):
        store.remove([("t", 0, 4)], chunk_counts=[2])
    assert sorted(r[2] for r in index_rows(store)) == [0, 4, 5, 6, 7, 8, 9]


def test_a_rebuild_moves_plain_removals_to_the_chunked_layout(tmp_path: Path) -> None:
    plain = Output(tmp_path, chunked=False)
    plain.segment("t", 0, 0, 4)
    store = IndexStore(tmp_path)
    store.sync()
    store.remove([("t", 0, 1)])
    Output(tmp_path).segment("t", 0, 5, 9)
    store.rebuild()
    served = {r[:3] for r in index_rows(store)}
    assert ("t", 0, 1) not in served and ("t", 0, 0) in served and ("t", 0, 9) in served
    removed = store.removed_ids(store.saved_meta())  # type: ignore[arg-type]
    assert [CHUNKED_IDS.decode(int(i))[2:] for i in removed] == [(1, 0)]
