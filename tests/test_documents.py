"""Upsert mode without a broker: how records name documents (pipeline.core.documents),
the segments' document columns (sinks.parquet), and the current view (sinks.view)
applied from them, read back with Lance's own package."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import lance
import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.core.documents import (
    BY_KAFKA_KEY,
    KEY_NOT_UTF8,
    KEY_TOO_LONG,
    MISSING_KEY,
    Deletion,
    DocumentKeys,
)
from pipeline.core.layout import SegmentKey, iter_segments
from pipeline.core.model_info import ModelInfo
from pipeline.core.records import BadRecord, GoodRecord, RecordParser, SourceRecord
from sinks.index.check import IndexReport
from sinks.index.check import check_index as check_index_files
from sinks.index.store import IndexStore, decode_id
from sinks.parquet import ParquetSink
from sinks.purge import purge
from sinks.segments import read_info
from sinks.view import ViewStore
from sinks.view_plan import newer

DIM = 8


def check_index(root: Path) -> IndexReport:
    """`pipeline index check` as the CLI runs it on an upsert output: against the view."""
    return check_index_files(root, judged=ViewStore(root).snapshot())


def source(offset: int, key: bytes | None, value: bytes | None, partition: int = 0, ts: int = 0):
    return SourceRecord("docs", partition, offset, ts, key, value)


def parsed(keys: DocumentKeys, *sources: SourceRecord) -> list:
    return keys.keyed([RecordParser().parse(s) for s in sources])


# -- keying ---------------------------------------------------------------------------


def test_a_record_is_keyed_by_its_id_then_by_its_kafka_key() -> None:
    keys = DocumentKeys()
    by_id, by_key = parsed(
        keys,
        source(0, b"k0", b'{"text": "a", "id": "doc-a"}'),
        source(1, b"k1", b'{"text": "b"}'),
    )
    assert keys.key_of(by_id) == "doc-a"
    assert keys.key_of(by_key) == "k1"
    assert DocumentKeys(BY_KAFKA_KEY).key_of(by_id) == "k0"


def test_a_tombstone_deletes_the_document_its_kafka_key_names() -> None:
    (deletion,) = parsed(DocumentKeys(), source(3, b"doc-a", None))
    assert isinstance(deletion, Deletion) and deletion.key == "doc-a"


@pytest.mark.parametrize(
    ("record", "error_class"),
    [
        (source(0, None, None), MISSING_KEY),  # a tombstone without a key
        (source(0, None, b'{"text": "a"}'), MISSING_KEY),  # no id, no key
        (source(0, b"", b'{"text": "a"}'), MISSING_KEY),
        (source(0, b"\xff\xfe", None), KEY_NOT_UTF8),
        (source(0, b"k" * 1025, b'{"text": "a"}'), KEY_TOO_LONG),
        (source(0, b"k", b'{"text": "a", "id": "' + b"i" * 2000 + b'"}'), KEY_TOO_LONG),
    ],
)
def test_a_record_naming_no_usable_document_is_a_bad_record(record, error_class) -> None:
    (bad,) = parsed(DocumentKeys(), record)
    assert isinstance(bad, BadRecord) and bad.error_class == error_class
    assert bad.message


def test_other_bad_records_stay_as_the_parser_judged_them() -> None:
    (bad,) = parsed(DocumentKeys(), source(0, b"k", b"not json"))
    assert isinstance(bad, BadRecord) and bad.error_class == "InvalidJson"


# -- segments and the view ------------------------------------------------------------


def model_info() -> ModelInfo:
    return ModelInfo(
        "test-model", "/m", "sha256:feedfacefeedface", DIM, "mean", True, 256, "fp32", "cpu",
        similarity="cosine",
    )  # fmt: skip


class Upserts:
    """An upsert-mode output written by the real sink, one segment per `write` call."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.keys = DocumentKeys()
        self.sink = ParquetSink(root, model_info(), self.keys)
        self.sink.prepare()
        self.next: dict[int, int] = {}
        self.rng = np.random.default_rng(7)
        self.vectors: dict[tuple[int, int], np.ndarray] = {}

    def write(self, *changes: tuple[str, str | None], partition: int = 0, ts: int = 0) -> None:
        """(document key, text) pairs; text None is a tombstone."""
        first = self.next.get(partition, 0)
        sources = [
            source(first + i, k.encode(), None if t is None else f'{{"text": "{t}"}}'.encode(),
                   partition, ts)
            for i, (k, t) in enumerate(changes)
        ]  # fmt: skip
        records = self.keys.keyed([RecordParser().parse(s) for s in sources])
        good = [r for r in records if isinstance(r, GoodRecord)]
        deletions = [r for r in records if isinstance(r, Deletion)]
        vectors = self.rng.standard_normal((len(good), DIM)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        for record, vector in zip(good, vectors, strict=True):
            self.vectors[(partition, record.source.offset)] = vector
        last = first + len(changes) - 1
        staged = self.sink.stage(
            SegmentKey("docs", partition, first), last, good, vectors,
            consumed=len(changes), deletions=deletions,
        )  # fmt: skip
        assert self.sink.publish(staged)
        self.next[partition] = last + 1

    def view(self) -> dict[str, dict]:
        table = lance.dataset(str(self.root / "current")).to_table()
        rows = table.to_pylist()
        assert len(rows) == len({r["doc_key"] for r in rows}), "one row per document"
        return {r["doc_key"]: r for r in rows}


def test_a_segment_holds_every_offset_with_its_document(tmp_path: Path) -> None:
    out = Upserts(tmp_path)
    out.write(("a", "one"), ("b", None), ("a", "two"))
    (segment,) = iter_segments(tmp_path)
    table = pq.read_table(segment.path)
    assert table.column("offset").to_pylist() == [0, 1, 2]
    assert table.column("doc_key").to_pylist() == ["a", "b", "a"]
    assert table.column("deleted").to_pylist() == [False, True, False]
    assert table.column("text").to_pylist() == ["one", "", "two"]
    assert not np.any(np.stack(table.column("embedding").to_numpy(zero_copy_only=False))[1])


def test_the_view_holds_the_latest_version_of_each_live_document(tmp_path: Path) -> None:
    out = Upserts(tmp_path)
    view = ViewStore(tmp_path)
    out.write(("doc1", "pasta on Mondays"), ("doc2", "salary records"), ("doc1", "curry"))
    out.write(("doc2", None), ("doc3", "third"))
    assert view.sync() == 5
    rows = out.view()
    assert sorted(rows) == ["doc1", "doc3"]
    assert rows["doc1"]["text"] == "curry" and rows["doc1"]["offset"] == 2
    np.testing.assert_array_equal(np.array(rows["doc1"]["embedding"]), out.vectors[(0, 2)])
    assert view.sync() == 0  # caught up: nothing applied twice
    # A deleted key may come back; a later update supersedes; a later delete removes.
    out.write(("doc2", "back again"), ("doc3", None), ("doc1", "soup"))
    view.sync()
    rows = out.view()
    assert {k: r["text"] for k, r in rows.items()} == {"doc1": "soup", "doc2": "back again"}
    assert view.positions() == {"docs:0": 7}


def test_each_apply_is_one_commit_that_records_its_positions(tmp_path: Path) -> None:
    out = Upserts(tmp_path)
    out.write(("a", "x"), ("b", "y"))
    ViewStore(tmp_path).sync()
    out.write(("a", None), ("b", "z"), ("c", "w"))
    ViewStore(tmp_path).sync()
    dataset = lance.dataset(str(tmp_path / "current"))
    before = dataset.checkout_version(dataset.version - 1).to_table().to_pylist()
    assert sorted(r["doc_key"] for r in before) == ["a", "b"]  # never half a batch
    assert sorted(r["doc_key"] for r in dataset.to_table().to_pylist()) == ["b", "c"]


def test_a_view_applied_in_small_steps_equals_one_applied_at_once(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    whole, steps = Upserts(tmp_path / "whole"), Upserts(tmp_path / "steps")
    for batch in range(12):
        changes = [
            (f"k{rng.integers(20)}", None if rng.random() < 0.2 else f"v{batch}-{i}")
            for i in range(int(rng.integers(1, 9)))
        ]
        for out in (whole, steps):
            out.write(*changes)
        ViewStore(tmp_path / "steps", max_apply_rows=3).sync()
    ViewStore(tmp_path / "whole").sync()
    expected: dict[str, str] = {}
    for segment in sorted(iter_segments(tmp_path / "whole"), key=lambda s: s.key.first):
        for row in pq.read_table(segment.path).to_pylist():
            if row["deleted"]:
                expected.pop(row["doc_key"], None)
            else:
                expected[row["doc_key"]] = row["text"]
    for out in (whole, steps):
        assert {k: r["text"] for k, r in out.view().items()} == expected


def test_across_partitions_the_later_timestamp_wins_whatever_the_order_applied(
    tmp_path: Path,
) -> None:
    out = Upserts(tmp_path)
    out.write(("doc", "newer"), partition=1, ts=2_000)
    ViewStore(tmp_path).sync()
    out.write(("doc", "older"), partition=0, ts=1_000)
    out.write(("doc", None), partition=0, ts=1_500)  # older than the live version too
    ViewStore(tmp_path).sync()
    assert out.view()["doc"]["text"] == "newer"


def test_a_key_at_the_same_offset_in_two_partitions_is_replaced(tmp_path: Path) -> None:
    """Partitions count offsets from 0 each: a document's versions at one offset in two
    partitions are two rows of the merge, told apart by their partition."""
    out = Upserts(tmp_path)
    view = ViewStore(tmp_path, index=IndexStore(tmp_path))
    out.write(("doc", "first"), ("other", "x"), partition=1, ts=1_000)
    view.sync()
    out.write(("doc", "second"), ("other", "y"), partition=0, ts=2_000)
    view.sync()  # raised "Ambiguous merge inserts" when merging on (doc_key, offset)
    rows = out.view()
    assert {k: (r["text"], r["partition"]) for k, r in rows.items()} == {
        "doc": ("second", 0), "other": ("y", 0),
    }  # fmt: skip
    out.write(("doc", None), partition=1, ts=3_000)
    view.sync()
    assert sorted(out.view()) == ["other"]


# Versions of five documents in three partitions, each partition's timestamps rising
# with its offsets: partition -> its segments, (timestamp, changes) each.
HISTORY: dict[int, list[tuple[int, list[tuple[str, str | None]]]]] = {
    0: [(1_000, [("kA", "a old"), ("kB", "b old"), ("kE", "e old")]),
        (5_000, [("kD", "d back")])],
    1: [(2_000, [("kA", None), ("kB", "b newer"), ("kE", None)]),
        (2_001, [("kB", None), ("kC", "c")])],
    2: [(1_500, [("kC", None), ("kD", "d")]),
        (4_000, [("kD", None), ("kA", "a back")])],
}  # fmt: skip
# By the rule, over every version: kA back after its delete, kB deleted for good (its
# older version in partition 0 stays dead), kC live (the tombstone is older), kD back
# after its delete, kE deleted (its older version stays dead).
LATEST = {"kA": "a back", "kC": "c", "kD": "d back"}


@pytest.mark.parametrize(
    "order",
    ["001122", "110022", "221100", "112200", "101202", "121020", "211002", "012012", "all"],
)
def test_the_view_is_the_same_whatever_the_order_partitions_are_applied_in(
    tmp_path: Path, order: str
) -> None:
    """Each key ends as its newest version, a tombstone being a version too: a version
    older than a key's delete stays deleted when its partition is applied after it."""
    out = Upserts(tmp_path)
    left = {p: list(segments) for p, segments in HISTORY.items()}
    for partition in [int(p) for p in order] if order != "all" else []:
        ts, changes = left[partition].pop(0)
        out.write(*changes, partition=partition, ts=ts)
        ViewStore(tmp_path, index=IndexStore(tmp_path)).sync()  # a restart each time
    for partition, segments in left.items():  # "all": one apply of everything
        for ts, changes in segments:
            out.write(*changes, partition=partition, ts=ts)
    ViewStore(tmp_path, index=IndexStore(tmp_path)).sync()
    assert {k: r["text"] for k, r in out.view().items()} == LATEST
    IndexStore(tmp_path).sync()
    report = check_index(tmp_path)  # a version kept dead is not served either
    assert report.ok and report.vectors == len(LATEST)


def test_keys_learned_by_an_apply_whose_commit_did_not_land_are_undone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Phase one (the key table) without phase two (the view's commit): the next apply
    sees the keys as the first attempt did, and counts each key in two partitions once."""
    from sinks import view as view_module

    out = Upserts(tmp_path)
    out.write(("a", "a0"), ("b", "b0"), partition=0, ts=1_000)
    ViewStore(tmp_path).sync()
    pinned = ViewStore(tmp_path).state().keys_version
    out.write(("a", None), ("b", "b1"), ("c", None), partition=1, ts=2_000)

    def killed(*args: object) -> None:
        raise RuntimeError("killed before the view's commit")

    monkeypatch.setattr(view_module, "commit", killed)
    with pytest.raises(RuntimeError):
        ViewStore(tmp_path).sync()
    written = lance.dataset(str(tmp_path / "current-keys"))
    assert sorted(written.to_table().column("doc_key").to_pylist()) == ["a", "b", "c"]
    assert ViewStore(tmp_path).state().keys_version == pinned  # named by no commit
    monkeypatch.undo()
    ViewStore(tmp_path).sync()
    assert {k: r["text"] for k, r in out.view().items()} == {"b": "b1"}
    state = ViewStore(tmp_path).state()
    assert (state.cross_partition, state.cross_partition_example) == (2, "a")
    # Older versions from partition 0 stay deleted; a key counts once however often seen.
    out.write(("a", "a older"), ("c", "c older"), ("b", "b older"), partition=0, ts=1_500)
    ViewStore(tmp_path).sync()
    assert {k: r["text"] for k, r in out.view().items()} == {"b": "b1"}
    assert ViewStore(tmp_path).state().cross_partition == 3  # a, b, c


def test_a_first_apply_that_did_not_create_the_view_counts_its_keys_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = Upserts(tmp_path)
    out.write(("a", "a0"), partition=0, ts=1_000)
    out.write(("a", None), ("b", None), partition=1, ts=2_000)

    def killed(*args: object) -> None:
        raise RuntimeError("killed before the view was made")

    monkeypatch.setattr(ViewStore, "_create", killed)
    with pytest.raises(RuntimeError):
        ViewStore(tmp_path).sync()
    assert (tmp_path / "current-keys").is_dir() and not (tmp_path / "current").exists()
    monkeypatch.undo()
    ViewStore(tmp_path).sync()
    assert out.view() == {}
    assert ViewStore(tmp_path).state().cross_partition == 1  # a
    out.write(("b", "b older"), partition=0, ts=1_500)
    ViewStore(tmp_path).sync()
    assert out.view() == {}
    assert ViewStore(tmp_path).state().cross_partition == 2  # a, b


def test_newer_orders_by_offset_in_a_partition_and_by_time_across() -> None:
    row = {"topic": "t", "partition": 0, "offset": 5, "timestamp": 100}
    assert newer(dict(row, offset=6, timestamp=1), row)
    assert newer(dict(row, partition=1, timestamp=101), row)
    assert not newer(dict(row, partition=1, timestamp=99, offset=99), row)
    assert newer(dict(row, partition=1), row)  # a tie: the larger partition


def test_the_index_leaves_deletions_out(tmp_path: Path) -> None:
    out = Upserts(tmp_path)
    out.write(("a", "x"), ("b", None), ("c", "y"))
    assert IndexStore(tmp_path).sync() == 2
    assert check_index(tmp_path).ok


def served(root: Path) -> list[int]:
    store = IndexStore(root)
    store.load()
    return sorted(decode_id(int(i))[2] for i in store.ids())


@pytest.mark.parametrize("index_first", [True, False])
def test_the_index_serves_the_live_versions_only(tmp_path: Path, index_first: bool) -> None:
    out = Upserts(tmp_path)
    view = ViewStore(tmp_path, index=IndexStore(tmp_path))
    out.write(("a", "a1"), ("b", "b1"), ("c", "c1"))
    out.write(("a", "a2"), ("b", None), ("a", "a3"), ("d", "d1"))
    if index_first:
        IndexStore(tmp_path).sync()
    view.sync()  # records the removals, whether the index holds those vectors yet or not
    IndexStore(tmp_path).sync()
    assert served(tmp_path) == [2, 5, 6]  # c1, a3, d1
    store = IndexStore(tmp_path)
    store.load()
    assert store.ntotal == 3
    report = check_index(tmp_path)
    assert report.ok and report.vectors == 3
    # A rebuild from the segments keeps them removed.
    IndexStore(tmp_path).rebuild()
    assert served(tmp_path) == [2, 5, 6] and check_index(tmp_path).ok


def test_index_check_finds_a_superseded_version_still_served(tmp_path: Path) -> None:
    out = Upserts(tmp_path)
    out.write(("a", "a1"), ("a", "a2"))
    IndexStore(tmp_path).sync()
    ViewStore(tmp_path).sync()  # a view that does not tell the index
    report = check_index(tmp_path)
    assert not report.ok and report.extra == 1


def test_many_removals_are_merged_into_one_file(tmp_path: Path) -> None:
    out = Upserts(tmp_path)
    view = ViewStore(tmp_path, index=IndexStore(tmp_path))
    for n in range(20):
        out.write(("a", f"a{n}"), ("b", f"b{n}"))
        view.sync()
    IndexStore(tmp_path).sync()
    meta = IndexStore(tmp_path).saved_meta()
    assert meta is not None and len(meta.removed) <= 16
    assert served(tmp_path) == [38, 39] and check_index(tmp_path).ok


def test_live_finds_only_the_live_versions(tmp_path: Path) -> None:
    out = Upserts(tmp_path)
    out.write(("a", "old"), ("b", "gone"), ("a", "new"), ("b", None), ("it's", "quoted"))
    view = ViewStore(tmp_path)
    view.sync()
    live = view.live([("docs", 0, o) for o in range(5)], ["doc_key", "offset", "text"])
    assert sorted(live.to_pylist(), key=lambda r: r["offset"]) == [
        {"doc_key": "a", "offset": 2, "text": "new"},
        {"doc_key": "it's", "offset": 4, "text": "quoted"},
    ]


# -- erasure --------------------------------------------------------------------------


def file_bytes(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())


def test_purge_erases_superseded_and_deleted_documents_from_every_file(tmp_path: Path) -> None:
    out = Upserts(tmp_path)
    secret, stale = "salary-records-room-12", "pasta-on-mondays"
    out.write(("doc1", stale), ("doc2", secret), ("doc3", "kept"))
    out.write(("doc1", "curry-on-mondays"), ("doc2", None))
    ViewStore(tmp_path, index=IndexStore(tmp_path)).sync()
    IndexStore(tmp_path).sync()
    erased_vectors = [out.vectors[(0, 0)], out.vectors[(0, 1)]]
    report = purge(tmp_path)
    assert report.erased_rows == 3  # doc1's first version, doc2, doc2's tombstone
    assert report.live_documents == 2 and report.index_vectors == 2
    # No file holds an erased text or vector, however it is read.
    for segment in iter_segments(tmp_path):
        table = pq.read_table(segment.path)
        assert not {secret, stale} & set(table.column("text").to_pylist())
        assert sorted(table.column("offset").to_pylist()) == [2, 3]
    raw = file_bytes(tmp_path)
    for text in (secret, stale):
        assert text.encode() not in raw
    for vector in erased_vectors:
        assert vector.astype(np.float32).tobytes() not in raw
    dataset = lance.dataset(str(tmp_path / "current"))
    assert len(dataset.versions()) == 1
    assert sorted(r["doc_key"] for r in dataset.to_table().to_pylist()) == ["doc1", "doc3"]
    assert check_index(tmp_path).ok
    # Offsets stay accounted for: the footers name the purged ones.
    (info,) = [read_info(s) for s in iter_segments(tmp_path)]
    assert info.purged == ((0, 1), (4, 4)) and info.records == 5 and info.dead_lettered == 0
    # The view and index go on from there; a second purge finds nothing more.
    out.write(("doc2", "back"))
    ViewStore(tmp_path).sync()
    assert purge(tmp_path).erased_rows == 0
    assert sorted(out.view()) == ["doc1", "doc2", "doc3"]


def test_a_version_kept_deleted_is_erased_and_the_key_table_holds_no_text(
    tmp_path: Path,
) -> None:
    out = Upserts(tmp_path)
    out.write(("doc", None), partition=1, ts=2_000)
    ViewStore(tmp_path, index=IndexStore(tmp_path)).sync()
    out.write(("doc", "erase-me-older-text"), ("other", "kept"), partition=0, ts=1_000)
    ViewStore(tmp_path, index=IndexStore(tmp_path)).sync()
    IndexStore(tmp_path).sync()
    assert sorted(out.view()) == ["other"]
    report = purge(tmp_path)
    assert report.erased_rows == 2  # the tombstone, and the version it keeps deleted
    assert b"erase-me-older-text" not in file_bytes(tmp_path)
    keys = lance.dataset(str(tmp_path / "current-keys")).to_table()
    assert keys.column_names == ["doc_key", "topic", "partition", "offset", "timestamp",
                                 "cross_partition"]  # fmt: skip
    assert keys.to_pylist() == [
        {"doc_key": "doc", "topic": "docs", "partition": 1, "offset": 0, "timestamp": 2_000,
         "cross_partition": True},
    ]  # fmt: skip
    assert check_index(tmp_path).ok
    # Still deleted after the purge erased the tombstone's row from the history.
    out.write(("doc", "still older"), partition=0, ts=1_900)
    ViewStore(tmp_path).sync()
    assert sorted(out.view()) == ["other"]


@pytest.mark.s3
def test_purge_on_an_object_store_leaves_no_earlier_index_generation(s3_url: str) -> None:
    """On an object store the index keeps earlier generations' shards a while, for
    readers; a purge removes them at once: they hold the erased versions' vectors."""
    from sinks.objectstore import ObjectStore

    store = ObjectStore.from_url(s3_url)
    out = Upserts(store)  # type: ignore[arg-type]
    out.write(("doc1", "old-text"), ("doc2", "deleted-text"))

    def sync() -> None:
        view = ViewStore(store, index=IndexStore(store))
        view.sync()
        view.close()  # the lease: the next apply, and the purge's, take it at once
        IndexStore(store).sync()  # a generation each, as a worker's syncs make

    for changes in ((("doc1", "new-text"),), (("doc2", None),), (("doc3", "kept"),)):
        sync()
        out.write(*changes)
    sync()
    erased = [out.vectors[(0, 0)], out.vectors[(0, 1)]]
    assert purge(store).erased_rows == 3
    raw = b"".join(store.get(o.key) for o in store.list(""))
    for vector in erased:
        assert vector.astype(np.float32).tobytes() not in raw
    assert b"old-text" not in raw and b"deleted-text" not in raw
    manifests = [o.key for o in store.list("index/") if "manifest-" in o.key]
    assert len(manifests) == 1
    assert check_index(store).ok  # type: ignore[arg-type]


# -- the view's lease on an object store ------------------------------------------------


@pytest.mark.s3
def test_one_worker_at_a_time_holds_the_view_lease(s3_url: str) -> None:
    from sinks.objectstore import ObjectStore
    from sinks.view_lock import StoreLease

    store = ObjectStore.from_url(s3_url)
    first, second = StoreLease(store, lease_s=7), StoreLease(store, lease_s=7)
    with first.held() as held:
        assert held and first.valid()
    with second.held() as held:
        assert not held  # the first holds it until it expires or is released
    first.release()
    with second.held() as held:
        assert held and second.valid()
    time.sleep(7.5)  # the second stalls past its lease
    assert not second.valid()  # its own clock says so: it commits nothing
    with first.held() as held:
        assert held
    assert not second.renew()


def test_a_workers_compaction_purges_when_asked(tmp_path: Path) -> None:
    import threading

    from sinks.compact_process import compact_in_child

    out = Upserts(tmp_path)
    out.write(("a", "old"), ("b", "gone"))
    out.write(("a", "new"), ("b", None))
    ViewStore(tmp_path, index=IndexStore(tmp_path)).sync()
    report = compact_in_child(tmp_path, 128 << 20, threading.Event(), purge=True)
    assert report is not None and report.erased == 3
    (segment,) = iter_segments(tmp_path)
    assert pq.read_table(segment.path).column("text").to_pylist() == ["new"]
    assert check_index(tmp_path).ok


def test_a_segment_larger_than_an_apply_is_applied_a_part_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sinks import view as view_module

    out = Upserts(tmp_path)
    out.write(*[(f"k{i % 37}", f"version {i}") for i in range(300)])
    monkeypatch.setattr(view_module, "MAX_APPLY_BYTES", 4096)
    view = ViewStore(tmp_path)
    assert view.sync() == 300
    assert view.last_sync.commits > 3
    assert {k: r["text"] for k, r in out.view().items()} == {
        f"k{j}": f"version {max(i for i in range(300) if i % 37 == j)}" for j in range(37)
    }
    assert view.positions() == {"docs:0": 299}


def test_upkeep_compacts_the_view_and_keeps_its_positions(tmp_path: Path) -> None:
    out = Upserts(tmp_path)
    view = ViewStore(tmp_path)
    for n in range(6):
        out.write(("a", f"a{n}"), (f"k{n}", "x"), ("b", None if n % 2 else f"b{n}"))
        view.sync()
    before = view.state()
    rows = out.view()
    fragments = len(lance.dataset(str(tmp_path / "current")).get_fragments())
    assert view.maintain(retention_s=0.0)
    dataset = lance.dataset(str(tmp_path / "current"))
    assert len(dataset.versions()) == 1 and len(dataset.get_fragments()) < fragments
    # The key table too, its compacted version named by the view's newest commit.
    keys = lance.dataset(str(tmp_path / "current-keys"))
    assert len(keys.versions()) == 1
    after = view.state()
    assert after.keys_version == keys.version
    assert dataclasses.replace(after, keys_version=before.keys_version) == before
    assert out.view() == rows
    assert keys.to_table().column("doc_key").to_pylist() == ["b"]  # deleted: remembered
    out.write(("a", "later"))
    assert view.sync() == 1 and out.view()["a"]["text"] == "later"


def test_a_view_left_without_its_key_index_gets_it_back(tmp_path: Path) -> None:
    out = Upserts(tmp_path)
    out.write(("a", "one"))
    view = ViewStore(tmp_path)
    view.sync()
    dataset = lance.dataset(str(tmp_path / "current"))
    dataset.drop_index("doc_key_idx")  # as if killed between the table and its index
    out.write(("a", "two"), ("b", "three"))
    view.sync()
    names = [i.name for i in lance.dataset(str(tmp_path / "current")).describe_indices()]
    assert names == ["doc_key_idx"]
    assert {k: r["text"] for k, r in out.view().items()} == {"a": "two", "b": "three"}
