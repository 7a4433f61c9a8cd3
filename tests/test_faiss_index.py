"""IndexStore: ids derived from records, incremental sync equal to a rebuild,
syncs that write only new vectors (shards, merged in tiers), crash-safe saves,
consistency checks, trained indexes, and several stores on one directory."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import IndexStateError
from pipeline.core.layout import INDEX_META_FILE, SegmentKey, index_dir, iter_segments, vectors_dir
from pipeline.core.model_info import ModelInfo
from pipeline.core.records import GoodRecord, SourceRecord
from sinks.index import store as faiss_mod
from sinks.index.check import check_index
from sinks.index.flat_files import flat_file_bytes
from sinks.index.shards import MERGE_FANOUT, Shard, next_merge
from sinks.index.store import IndexStore, decode_id, encode_id
from sinks.parquet import ParquetSink, StagedFile

DIM = 16
Row = tuple[str, int, int]


def model_info(dim: int = DIM, similarity: str = "cosine", normalize: bool = True) -> ModelInfo:
    return ModelInfo(
        "test-model", "/m", "sha256:feedfacefeedface", dim, "mean", normalize, 256, "fp32",
        "cpu", similarity=similarity,
    )  # fmt: skip


class Output:
    """An output directory with Parquet segments written by the real sink: unit vectors,
    or (`similarity` given) vectors of many lengths, as models without Normalize give."""

    def __init__(self, root: Path, dim: int = DIM, similarity: str | None = None) -> None:
        self.root = root
        self.unit = similarity is None
        self.sink = ParquetSink(root, model_info(dim, similarity or "cosine", self.unit))
        self.sink.prepare()
        self.dim = dim
        self.vectors: dict[Row, np.ndarray] = {}
        self._rng = np.random.default_rng(1234)

    def segment(
        self, topic: str, partition: int, first: int, last: int, skip: tuple[int, ...] = ()
    ) -> int:
        """Publishes a segment covering first..last; offsets in `skip` were bad records."""
        staged = self._stage(topic, partition, first, last, skip)
        assert self.sink.publish(staged)
        return staged.rows

    def legacy_segment(self, topic: str, partition: int, first: int, last: int) -> int:
        """A segment as older versions named it (`<first>-<last>`), overlaps allowed."""
        staged = self._stage(topic, partition, first, last, ())
        name = f"{topic}-p{partition:05d}-{first:020d}-{last:020d}.parquet"
        staged.tmp_path.rename(vectors_dir(self.root) / name)
        return staged.rows

    def _stage(
        self, topic: str, partition: int, first: int, last: int, skip: tuple[int, ...]
    ) -> StagedFile:
        offsets = [o for o in range(first, last + 1) if o not in skip]
        recs = [
            GoodRecord(SourceRecord(topic, partition, o, 0, None, b"{}"), f"t{o}", None, None)
            for o in offsets
        ]
        v = self._rng.standard_normal((len(offsets), self.dim)).astype(np.float32)
        v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        if not self.unit:
            v *= self._rng.uniform(0.2, 5.0, (len(v), 1)).astype(np.float32)
        for o, row in zip(offsets, v, strict=True):
            self.vectors[(topic, partition, o)] = row
        key = SegmentKey(topic, partition, first)
        return self.sink.stage(key, last, recs, v, consumed=last - first + 1)

    def parquet_rows(self) -> list[Row]:
        rows: list[Row] = []
        for segment in iter_segments(self.root):
            table = pq.read_table(segment.path, columns=["topic", "partition", "offset"])
            rows += zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True)
        return rows


def index_rows(store: IndexStore) -> list[Row]:
    """The (topic, partition, offset) of every id in the store's index."""
    assert store.meta is not None
    topics = {no: name for name, no in store.meta.topics.items()}
    out = []
    for vector_id in store.ids().tolist():
        topic_no, partition, offset = decode_id(vector_id)
        out.append((topics[topic_no], partition, offset))
    return out


def fresh_rows(root: Path) -> list[Row]:
    store = IndexStore(root)
    store.load()
    assert store.ntotal == store.meta.count  # type: ignore[union-attr]
    return index_rows(store)


def meta_json(root: Path) -> dict:
    return json.loads((index_dir(root) / INDEX_META_FILE).read_text())


def shard_files(root: Path) -> list[Path]:
    return [index_dir(root) / s["file"] for s in meta_json(root)["shards"]]


def index_files_on_disk(root: Path) -> set[str]:
    return {p.name for p in index_dir(root).iterdir() if p.suffix == ".faiss"}


@pytest.fixture
def out(tmp_path: Path) -> Output:
    return Output(tmp_path)


# ------------------------------------------------------------------ ids


@pytest.mark.parametrize(
    ("topic_no", "partition", "offset"),
    [(0, 0, 0), (1, 2, 3), (5, 65535, 123_456_789), (127, 65535, (1 << 40) - 1)],
)
def test_encode_decode_round_trip(topic_no: int, partition: int, offset: int) -> None:
    vector_id = encode_id(topic_no, partition, offset)
    assert 0 <= vector_id < 1 << 63  # a FAISS id is a signed int64
    assert decode_id(vector_id) == (topic_no, partition, offset)


def test_encode_ids_are_distinct_for_distinct_records() -> None:
    triples = [(t, p, o) for t in (0, 1, 127) for p in (0, 1, 65535) for o in (0, 1, 1 << 39)]
    assert len({encode_id(*x) for x in triples}) == len(triples)


@pytest.mark.parametrize(
    ("topic_no", "partition", "offset"),
    [(128, 0, 0), (-1, 0, 0), (0, 65536, 0), (0, -1, 0), (0, 0, 1 << 40), (0, 0, -1)],
)
def test_encode_id_out_of_bounds(topic_no: int, partition: int, offset: int) -> None:
    with pytest.raises(IndexStateError):
        encode_id(topic_no, partition, offset)


# ------------------------------------------------------------------ sync


def test_sync_adds_exactly_the_new_segments(out: Output) -> None:
    n1 = out.segment("t", 0, 0, 9, skip=(3,))
    n2 = out.segment("t", 1, 0, 4)
    store = IndexStore(out.root)
    assert store.sync() == n1 + n2 == 14
    assert store.sync() == 0
    n3 = out.segment("t", 0, 10, 19)
    assert store.sync() == n3 == 10
    assert store.sync() == 0
    assert store.ntotal == 24
    assert Counter(index_rows(store)) == Counter(out.parquet_rows())


def test_ids_map_back_to_topic_partition_offset(out: Output) -> None:
    out.segment("alpha.x", 0, 0, 4)
    out.segment("beta-y", 3, 100, 102, skip=(101,))
    store = IndexStore(out.root)
    store.sync()
    rows = index_rows(store)
    assert sorted(rows) == sorted(out.parquet_rows())
    assert ("beta-y", 3, 100) in rows and ("beta-y", 3, 101) not in rows


def test_index_json_entries_equal_parquet_rows(out: Output) -> None:
    out.segment("t", 0, 0, 9, skip=(0, 5))
    out.segment("t", 0, 10, 12, skip=(10, 11, 12))  # only bad records
    out.segment("t", 2, 7, 8)
    out.segment("u", 0, 0, 0)
    IndexStore(out.root).sync()
    data = meta_json(out.root)
    per_partition = Counter(f"{t}:{p}" for t, p, _ in out.parquet_rows())
    assert data["entries"] == dict(per_partition)
    assert data["count"] == sum(per_partition.values()) == 11
    assert data["covered"] == {"t:0": 12, "t:2": 8, "u:0": 0}
    assert data["dim"] == DIM
    assert data["model"]["model_revision"] == "sha256:feedfacefeedface"


def test_search_finds_the_record_itself_first(out: Output) -> None:
    out.segment("t", 0, 0, 49)
    out.segment("u", 1, 0, 29)
    store = IndexStore(out.root)
    store.sync()
    keys = [("t", 0, 7), ("u", 1, 29), ("t", 0, 0)]
    queries = np.stack([out.vectors[k] for k in keys])
    results = store.search(queries, k=5)
    for key, hits in zip(keys, results, strict=True):
        assert len(hits) == 5
        assert (hits[0].topic, hits[0].partition, hits[0].offset) == key
        assert hits[0].score == pytest.approx(1.0, abs=1e-5)
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)


def test_search_from_a_fresh_store_loads_the_saved_index(out: Output) -> None:
    out.segment("t", 0, 0, 19)
    IndexStore(out.root).sync()
    hits = IndexStore(out.root).search(out.vectors[("t", 0, 11)][None, :], k=1)[0]
    assert (hits[0].topic, hits[0].partition, hits[0].offset) == ("t", 0, 11)


def test_rebuild_gives_the_same_ids_as_incremental_syncs(out: Output) -> None:
    store = IndexStore(out.root)
    out.segment("t", 0, 0, 9)
    store.sync()
    out.segment("t", 1, 0, 3, skip=(2,))
    out.segment("u.v", 0, 5, 9)
    store.sync()
    out.segment("t", 0, 10, 14)
    store.sync()
    incremental = sorted(store.ids().tolist())
    assert len(incremental) == len(set(incremental)) == len(out.parquet_rows())

    rebuilt = IndexStore(out.root)
    assert rebuilt.rebuild() == len(incremental)
    assert sorted(rebuilt.ids().tolist()) == incremental
    assert sorted(fresh_rows(out.root)) == sorted(out.parquet_rows())
    # syncing after a rebuild adds nothing
    assert IndexStore(out.root).sync() == 0


def test_rebuild_without_parquet_files_raises(tmp_path: Path) -> None:
    with pytest.raises(IndexStateError, match="no Parquet files"):
        IndexStore(tmp_path).rebuild()


def test_load_without_an_index_raises(tmp_path: Path) -> None:
    with pytest.raises(IndexStateError, match="no index"):
        IndexStore(tmp_path).load()


def test_overlapping_legacy_segments_give_one_entry_per_record(out: Output) -> None:
    # Older versions could leave overlapping files behind; the index must not
    # double them, nor crash on them (every sync at every start would).
    out.legacy_segment("t", 0, 0, 9)
    store = IndexStore(out.root)
    assert store.sync() == 10
    out.legacy_segment("t", 0, 5, 14)
    assert store.sync() == 5
    out.legacy_segment("t", 0, 0, 14)
    assert store.sync() == 0
    assert sorted(fresh_rows(out.root)) == [("t", 0, o) for o in range(15)]
    assert IndexStore(out.root).rebuild() == 15
    assert sorted(fresh_rows(out.root)) == [("t", 0, o) for o in range(15)]


def test_a_damaged_segment_stops_its_partition_until_repaired(out: Output) -> None:
    out.segment("t", 0, 0, 9)
    out.segment("t", 0, 10, 19)
    out.segment("t", 0, 20, 29)
    out.segment("t", 1, 0, 4)
    damaged = vectors_dir(out.root) / SegmentKey("t", 0, 10).filename
    good = damaged.read_bytes()
    damaged.write_bytes(good[:100])  # truncated, with a valid name
    store = IndexStore(out.root)
    assert store.sync() == 15  # partition 0 up to the damage, and all of partition 1
    assert [d.segment.path for d in store.damaged] == [damaged]
    assert meta_json(out.root)["covered"] == {"t:0": 9, "t:1": 4}
    damaged.write_bytes(good)  # repaired (a worker writes the range again)
    assert store.sync() == 20
    assert sorted(fresh_rows(out.root)) == sorted(out.parquet_rows())


def test_a_segment_rewritten_past_the_coverage_adds_only_the_new_rows(out: Output) -> None:
    # The last segment of a partition was damaged after the index read it; its
    # next owner reads the partition again from its first offset, further on.
    out.segment("t", 0, 0, 9)
    out.segment("t", 0, 10, 14)
    store = IndexStore(out.root)
    assert store.sync() == 15
    (vectors_dir(out.root) / SegmentKey("t", 0, 10).filename).unlink()
    out.segment("t", 0, 10, 24)
    assert store.sync() == 10
    assert sorted(fresh_rows(out.root)) == [("t", 0, o) for o in range(25)]


def test_segment_of_another_dimension_raises(tmp_path: Path) -> None:
    Output(tmp_path, DIM).segment("t", 0, 0, 3)
    IndexStore(tmp_path).sync()
    Output(tmp_path, DIM * 2).segment("t", 0, 4, 6)
    with pytest.raises(IndexStateError, match="-d"):
        IndexStore(tmp_path).sync()


# ------------------------------------------------------------------ crash safety


def test_stray_new_index_file_from_a_crash_is_ignored(out: Output) -> None:
    out.segment("t", 0, 0, 9)
    IndexStore(out.root).sync()
    directory = index_dir(out.root)
    current = meta_json(out.root)
    # a crash after writing the next shard but before renaming index.json:
    stray = directory / f"shard-{current['generation'] + 1:08d}-0001.faiss"
    stray.write_bytes(b"half a faiss file")
    (directory / f".{INDEX_META_FILE}.99999.tmp").write_text('{"dim": 16, "generat')
    store = IndexStore(out.root)
    store.load()
    assert store.ntotal == 10
    assert sorted(index_rows(store)) == sorted(out.parquet_rows())
    # and the next sync moves on past the debris
    out.segment("t", 0, 10, 12)
    assert IndexStore(out.root).sync() == 3
    assert sorted(fresh_rows(out.root)) == sorted(out.parquet_rows())
    assert index_files_on_disk(out.root) == {p.name for p in shard_files(out.root)}


class Crash(BaseException):
    """Stands for the process dying: no except/finally clean-up of the code under test."""


def test_crash_before_index_json_rename_keeps_old_state(
    out: Output, monkeypatch: pytest.MonkeyPatch
) -> None:
    out.segment("t", 0, 0, 9)
    IndexStore(out.root).sync()
    before = meta_json(out.root)
    out.segment("t", 0, 10, 19)

    def die(*_args: object) -> None:
        raise Crash

    with monkeypatch.context() as m:
        m.setattr(faiss_mod.os, "rename", die)
        with pytest.raises(Crash):
            IndexStore(out.root).sync()
    # the new shard was written, index.json was not switched
    assert len(index_files_on_disk(out.root)) == 2
    assert meta_json(out.root) == before
    store = IndexStore(out.root)
    store.load()
    assert store.ntotal == 10
    # the next worker adds the segment once
    assert IndexStore(out.root).sync() == 10
    rows = fresh_rows(out.root)
    assert len(rows) == len(set(rows)) == 20


def test_index_disagreeing_with_its_metadata_raises(out: Output) -> None:
    out.segment("t", 0, 0, 9)
    IndexStore(out.root).sync()
    path = index_dir(out.root) / INDEX_META_FILE
    data = json.loads(path.read_text())
    data["entries"]["t:0"] = 7
    path.write_text(json.dumps(data))
    with pytest.raises(IndexStateError, match="rebuild"):
        IndexStore(out.root).load()
    with pytest.raises(IndexStateError):
        IndexStore(out.root).sync()
    # the documented way out works
    assert IndexStore(out.root).rebuild() == 10
    assert len(fresh_rows(out.root)) == 10


def test_index_file_swapped_for_another_raises(out: Output) -> None:
    out.segment("t", 0, 0, 9)
    IndexStore(out.root).sync()
    saved = shard_files(out.root)[0].read_bytes()
    out.segment("t", 0, 10, 14)
    IndexStore(out.root).sync()
    shard_files(out.root)[-1].write_bytes(saved)  # 10 vectors where 5 belong
    for act in (IndexStore(out.root).load, IndexStore(out.root).sync):
        with pytest.raises(IndexStateError, match="damaged or replaced"):
            act()
    assert IndexStore(out.root).rebuild() == 15


def test_missing_index_file_raises_index_state_error(out: Output) -> None:
    out.segment("t", 0, 0, 4)
    IndexStore(out.root).sync()
    shard_files(out.root)[0].unlink()
    for act in (IndexStore(out.root).load, IndexStore(out.root).sync):
        with pytest.raises(IndexStateError, match="missing"):
            act()


# ------------------------------------------------------------------ several stores


def test_two_stores_syncing_alternately_never_duplicate_ids(out: Output) -> None:
    a, b = IndexStore(out.root), IndexStore(out.root)
    out.segment("t", 0, 0, 9)
    assert a.sync() == 10
    out.segment("t", 0, 10, 19)
    out.segment("t", 1, 0, 4)
    assert b.sync() == 15  # b reads a's save, adds only what is new
    out.segment("t", 0, 20, 24)
    assert a.sync() == 5  # a reloads b's save first
    assert b.sync() == 0
    assert a.sync() == 0
    out.segment("u", 0, 0, 2)
    assert b.sync() == 3
    for store in (a, b):
        store.sync()
        ids = store.ids().tolist()
        assert len(ids) == len(set(ids))
    rows = fresh_rows(out.root)
    assert len(rows) == len(set(rows))
    assert sorted(rows) == sorted(out.parquet_rows())
    assert meta_json(out.root)["count"] == len(out.parquet_rows()) == 33


def test_stale_store_after_a_rebuild_does_not_duplicate(out: Output) -> None:
    a = IndexStore(out.root)
    out.segment("t", 0, 0, 9)
    a.sync()
    out.segment("t", 0, 10, 19)
    IndexStore(out.root).sync()
    IndexStore(out.root).rebuild()
    out.segment("t", 0, 20, 29)
    a.sync()
    rows = fresh_rows(out.root)
    assert len(rows) == len(set(rows))
    assert sorted(rows) == sorted(out.parquet_rows())


def test_rebuild_keeps_ids_when_topics_appeared_out_of_name_order(out: Output) -> None:
    store = IndexStore(out.root)
    out.segment("zeta", 0, 0, 9)
    store.sync()  # zeta is topic #0
    out.segment("alpha", 0, 100, 104)
    store.sync()  # alpha is topic #1
    incremental = sorted(store.ids().tolist())
    rebuilt = IndexStore(out.root)
    rebuilt.rebuild()
    assert sorted(rebuilt.ids().tolist()) == incremental


def test_search_with_k_larger_than_the_index(out: Output) -> None:
    out.segment("t", 0, 0, 2)
    store = IndexStore(out.root)
    store.sync()
    hits = store.search(out.vectors[("t", 0, 1)][None, :], k=10)[0]
    assert sorted(h.offset for h in hits) == [0, 1, 2]
    assert hits[0].offset == 1


def test_ivf_rebuild_indexes_every_row_and_later_syncs_add_to_it(out: Output) -> None:
    out.segment("t", 0, 0, 199)
    store = IndexStore(out.root, index_type="ivf")
    assert store.rebuild() == 200
    assert meta_json(out.root)["index_type"] == "ivf"
    out.segment("t", 0, 200, 209)
    assert IndexStore(out.root).sync() == 10  # a worker's (flat) store extends the IVF index
    rows = fresh_rows(out.root)
    assert sorted(rows) == sorted(out.parquet_rows())


def test_ivf_rebuild_needs_enough_vectors(out: Output) -> None:
    out.segment("t", 0, 0, 9)
    with pytest.raises(IndexStateError, match="64"):
        IndexStore(out.root, index_type="ivf").rebuild()


def test_ivf_store_sync_on_a_fresh_directory_does_not_crash(out: Output) -> None:
    out.segment("t", 0, 0, 99)
    try:
        added = IndexStore(out.root, index_type="ivf").sync()
    except IndexStateError:
        return  # a clear, expected error is acceptable
    assert added == 100


# ------------------------------------------------------------------ shards


def test_a_sync_writes_only_the_new_vectors_and_reads_no_shard(
    out: Output, monkeypatch: pytest.MonkeyPatch
) -> None:
    for first in range(0, 2000, 500):
        out.segment("t", 0, first, first + 499)
    store = IndexStore(out.root)
    assert store.sync() == 2000
    out.segment("t", 0, 2000, 2009)

    def no_reading(*_args: object) -> None:
        raise AssertionError("a sync read a shard it did not need")

    with monkeypatch.context() as m:
        m.setattr(faiss_mod, "read_index_file", no_reading)
        assert store.sync() == 10
    json_bytes = (index_dir(out.root) / INDEX_META_FILE).stat().st_size
    assert store.last_sync.bytes_written <= flat_file_bytes(DIM, 10) + json_bytes + 100
    assert store.last_sync.shards_written == 1
    assert sorted(fresh_rows(out.root)) == sorted(out.parquet_rows())


@pytest.mark.parametrize("files", ["streamed", "faiss"])
def test_small_shards_merge_in_tiers_under_the_cap(
    out: Output, files: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """Both ways of writing shards (sinks.index.flat_files, and faiss where the layout is
    not the one it streams) give the same index."""
    from sinks.index.flat_files import flat_layout

    monkeypatch.setenv("PIPELINE_FLAT_FILES", files)
    flat_layout.cache_clear()
    request.addfinalizer(flat_layout.cache_clear)
    assert (flat_layout(DIM) is None) == (files == "faiss")
    cap = 64
    store = IndexStore(out.root, shard_cap=cap)
    most_written = 0
    for n in range(100):
        out.segment("t", n % 2, n * 3, n * 3 + 2)
        assert store.sync() == 3
        most_written = max(most_written, store.last_sync.bytes_written)
    shards = meta_json(out.root)["shards"]
    assert max(s["count"] for s in shards) <= cap
    assert sum(s["count"] for s in shards) == 300
    # 300 vectors lie in about 2 * 300 / cap sealed shards plus unfilled tiers
    assert len(shards) <= 2 * 300 // cap + 2 * (MERGE_FANOUT - 1)
    # what one sync writes is bounded by the cap, not by the corpus
    assert most_written <= 2 * flat_file_bytes(DIM, cap) + 4096
    assert index_files_on_disk(out.root) == {p.name for p in shard_files(out.root)}
    rows = fresh_rows(out.root)
    assert len(rows) == len(set(rows)) == 300
    assert sorted(rows) == sorted(out.parquet_rows())


def test_next_merge_takes_a_full_tier_and_leaves_big_shards_alone() -> None:
    small = [Shard(f"s{i}", 3) for i in range(MERGE_FANOUT)]
    assert next_merge(small[:-1], cap=1000) == []
    assert next_merge(small, cap=1000) == small
    sealed = [Shard(f"b{i}", 600) for i in range(MERGE_FANOUT * 2)]
    assert next_merge(sealed, cap=1000) == []
    trained = [Shard(f"i{i}", 3, "ivf") for i in range(MERGE_FANOUT)]
    assert next_merge(trained, cap=1000) == []


def test_an_index_saved_before_shards_is_read_and_extended(out: Output) -> None:
    out.segment("t", 0, 0, 9)
    IndexStore(out.root).sync()
    data = meta_json(out.root)
    old_name = f"index-{data['generation']:08d}.faiss"
    shard_files(out.root)[0].rename(index_dir(out.root) / old_name)
    del data["shards"]
    data["index_file"] = old_name
    (index_dir(out.root) / INDEX_META_FILE).write_text(json.dumps(data))
    assert sorted(fresh_rows(out.root)) == sorted(out.parquet_rows())
    out.segment("t", 0, 10, 14)
    assert IndexStore(out.root).sync() == 5
    assert old_name in {s["file"] for s in meta_json(out.root)["shards"]}
    assert sorted(fresh_rows(out.root)) == sorted(out.parquet_rows())


@pytest.mark.parametrize("index_type", ["ivf", "ivf-pq"])
def test_trained_rebuild_reports_recall_and_indexes_every_row(out: Output, index_type: str) -> None:
    for first in range(0, 1200, 300):
        out.segment("t", 0, first, first + 299)
    assert IndexStore(out.root, index_type=index_type).rebuild() == 1200
    data = meta_json(out.root)
    assert data["index_type"] == index_type
    assert [s["kind"] for s in data["shards"]] == [index_type]
    assert 0.1 <= data["recall_at_10"] <= 1.0
    out.segment("t", 0, 1200, 1209)
    assert IndexStore(out.root).sync() == 10  # a worker adds a flat shard after it
    rows = fresh_rows(out.root)
    assert len(rows) == len(set(rows)) == 1210
    hits = IndexStore(out.root).search(out.vectors[("t", 0, 1205)][None, :], k=1)[0]
    assert (hits[0].topic, hits[0].partition, hits[0].offset) == ("t", 0, 1205)


# ------------------------------------------------------------------ pipeline index check


def run_check(root: Path) -> tuple[int, dict]:
    from click.testing import CliRunner

    from pipeline.cli import main

    result = CliRunner().invoke(main, ["index", "check", "--output", str(root), "--json"])
    report, _ = json.JSONDecoder().raw_decode(result.stdout)
    return result.exit_code, report


def test_index_check_passes_on_a_synced_output_and_counts_unsynced_rows(out: Output) -> None:
    out.segment("t", 0, 0, 9, skip=(4,))
    out.segment("u", 1, 0, 4)
    IndexStore(out.root).sync()
    out.segment("t", 0, 10, 12)
    code, report = run_check(out.root)
    assert code == 0
    assert report["ok"] and report["vectors"] == 14 and report["uncovered_rows"] == 3
    assert report["missing"] == report["extra"] == report["doubled"] == 0


def test_index_check_fails_when_rows_and_ids_disagree(out: Output) -> None:
    out.segment("t", 0, 0, 9)
    out.segment("t", 0, 10, 19)
    IndexStore(out.root).sync()
    (vectors_dir(out.root) / SegmentKey("t", 0, 10).filename).unlink()  # rows gone, ids stay
    code, report = run_check(out.root)
    assert code == 65
    assert report["extra"] == 10 and report["missing"] == 0 and not report["ok"]


def test_index_check_measures_recall_of_a_trained_index_now(out: Output) -> None:
    for first in range(0, 1200, 300):
        out.segment("t", 0, first, first + 299)
    IndexStore(out.root, index_type="ivf").rebuild()
    out.segment("t", 0, 1200, 1239)
    IndexStore(out.root).sync()
    report = check_index(out.root, recall=True)
    assert report.ok and report.measured_recall_at_10 is not None
    assert 0.1 <= report.measured_recall_at_10 <= 1.0
    flat = IndexStore(out.root)
    flat.rebuild()
    assert check_index(out.root, recall=True).measured_recall_at_10 == pytest.approx(1.0)


def test_scratch_folders_of_killed_workers_are_removed(tmp_path, monkeypatch) -> None:
    """An object-store index keeps local scratch copies in TMPDIR; a SIGKILLed worker
    cannot remove its folder, so the next worker on the machine does."""
    import os
    import subprocess
    import sys

    from sinks.index import files as index_files

    monkeypatch.setattr(index_files.tempfile, "gettempdir", lambda: str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead = tmp_path / f"pipeline-index-{gone.stdout.strip()}-abc"
    alive = tmp_path / f"pipeline-index-{os.getpid()}-def"
    other = tmp_path / "pipeline-index-notapid"
    for folder in (dead, alive, other):
        folder.mkdir()
        (folder / "shard.faiss").write_bytes(b"x")
    index_files._remove_scratch_of_dead_processes()
    assert not dead.exists()
    assert alive.exists() and other.exists()


# ------------------------------------------------------------------ similarity


def reference_scores(queries: np.ndarray, corpus: np.ndarray, similarity: str) -> np.ndarray:
    """SentenceTransformer.similarity's definitions, in numpy."""
    if similarity == "cosine":
        unit = lambda x: x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)  # noqa: E731
        return unit(queries) @ unit(corpus).T
    if similarity == "dot":
        return queries @ corpus.T
    difference = queries[:, None, :] - corpus[None, :, :]
    if similarity == "euclidean":
        return -np.sqrt((difference**2).sum(-1))
    return -np.abs(difference).sum(-1)


def offsets_and_vectors(out: Output) -> tuple[list[int], np.ndarray]:
    offsets = sorted(o for (_, _, o) in out.vectors)
    return offsets, np.stack([out.vectors[("t", 0, o)] for o in offsets])


@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean", "manhattan"])
def test_the_index_ranks_and_scores_by_the_recorded_similarity(
    tmp_path: Path, similarity: str
) -> None:
    out = Output(tmp_path, similarity=similarity)
    out.segment("t", 0, 0, 199)
    out.segment("t", 0, 200, 299)
    store = IndexStore(out.root, shard_cap=128)
    assert store.sync() == 300
    assert meta_json(out.root)["similarity"] == similarity
    assert meta_json(out.root)["model"]["similarity"] == similarity
    offsets, corpus = offsets_and_vectors(out)
    queries = np.random.default_rng(5).standard_normal((8, DIM)).astype(np.float32) * 3
    expected = reference_scores(queries, corpus, similarity)
    for query, row in zip(IndexStore(out.root).search(queries, k=10), expected, strict=True):
        best = np.argsort(-row, kind="stable")[:10]
        assert [h.offset for h in query] == [offsets[i] for i in best]
        np.testing.assert_allclose([h.score for h in query], row[best], rtol=1e-4, atol=1e-4)


def test_the_parquet_keeps_the_vectors_and_only_the_cosine_index_normalises(
    tmp_path: Path,
) -> None:
    from sinks.index.shards import contents, read_index_file

    for similarity, normalised in (("cosine", True), ("dot", False), ("euclidean", False)):
        out = Output(tmp_path / similarity, similarity=similarity)
        out.segment("t", 0, 0, 9)
        IndexStore(out.root).sync()
        (shard,) = meta_json(out.root)["shards"]
        vectors, _ = contents(read_index_file(index_dir(out.root) / shard["file"], 10))
        _, stored = offsets_and_vectors(out)
        if normalised:
            stored = stored / np.linalg.norm(stored, axis=1, keepdims=True)
        np.testing.assert_allclose(vectors, stored, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("index_type", "similarity"),
    [("ivf", "dot"), ("ivf", "euclidean"), ("ivf", "manhattan"), ("ivf-pq", "euclidean")],
)
def test_trained_indexes_search_by_the_similarity(
    tmp_path: Path, index_type: str, similarity: str
) -> None:
    out = Output(tmp_path, similarity=similarity)
    for first in range(0, 1200, 300):
        out.segment("t", 0, first, first + 299)
    assert IndexStore(out.root, index_type=index_type).rebuild() == 1200
    data = meta_json(out.root)
    assert (data["similarity"], data["index_type"]) == (similarity, index_type)
    assert 0.1 <= data["recall_at_10"] <= 1.0
    out.segment("t", 0, 1200, 1209)
    assert IndexStore(out.root).sync() == 10  # a flat shard of the same metric after it
    report = check_index(out.root, recall=True)
    assert report.ok and report.similarity == similarity
    assert 0.1 <= (report.measured_recall_at_10 or 0) <= 1.0
    hits = IndexStore(out.root).search(out.vectors[("t", 0, 1205)][None, :], k=1)[0]
    if similarity != "dot":  # a vector is its own nearest by a distance (not by dot)
        assert hits[0].offset == 1205
        if index_type == "ivf":  # IVF-PQ's distances are of the quantised vectors
            assert hits[0].score == pytest.approx(0.0, abs=1e-3)


def test_an_index_type_without_the_metric_is_refused_in_one_line(tmp_path: Path) -> None:
    out = Output(tmp_path, similarity="manhattan")
    for first in range(0, 1200, 300):
        out.segment("t", 0, first, first + 299)
    with pytest.raises(IndexStateError) as refused:
        IndexStore(out.root, index_type="ivf-pq").rebuild()
    assert "manhattan" in str(refused.value) and "\n" not in str(refused.value)
    assert not index_dir(out.root).exists() or not index_files_on_disk(out.root)


def test_a_rebuild_may_choose_the_similarity(out: Output) -> None:
    out.segment("t", 0, 0, 49)
    IndexStore(out.root).sync()
    assert meta_json(out.root)["similarity"] == "cosine"
    IndexStore(out.root, similarity="euclidean").rebuild()
    assert meta_json(out.root)["similarity"] == "euclidean"
    out.segment("t", 0, 50, 59)
    assert IndexStore(out.root).sync() == 10  # syncs keep the index's similarity
    assert meta_json(out.root)["similarity"] == "euclidean"
    assert sorted(fresh_rows(out.root)) == sorted(out.parquet_rows())


def test_a_shard_of_another_metric_than_index_json_is_refused(tmp_path: Path) -> None:
    out = Output(tmp_path, similarity="dot")
    out.segment("t", 0, 0, 9)
    IndexStore(out.root).sync()
    data = meta_json(out.root)
    data["similarity"] = "euclidean"  # same file size: only the header tells
    (index_dir(out.root) / INDEX_META_FILE).write_text(json.dumps(data))
    with pytest.raises(IndexStateError, match="pipeline index rebuild") as refused:
        IndexStore(out.root).load()
    assert "\n" not in str(refused.value)


def legacy(root: Path) -> None:
    """index.json as releases before similarities were recorded wrote it."""
    data = meta_json(root)
    del data["similarity"]
    del data["model"]["similarity"]
    (index_dir(root) / INDEX_META_FILE).write_text(json.dumps(data))


def test_an_index_from_before_similarities_is_an_inner_product_and_stays_one(
    tmp_path: Path,
) -> None:
    from sinks.index.shards import contents, read_index_file

    out = Output(tmp_path, similarity="dot")
    out.segment("t", 0, 0, 99)
    IndexStore(out.root).sync()
    legacy(out.root)
    offsets, corpus = offsets_and_vectors(out)
    query = corpus[7:8] * 2
    hits = IndexStore(out.root).search(query, k=5)[0]
    best = np.argsort(-(query @ corpus.T)[0], kind="stable")[:5]
    assert [h.offset for h in hits] == [offsets[i] for i in best]
    # A worker of this release extends it as it is: raw vectors, inner product.
    out.segment("t", 0, 100, 109)
    assert IndexStore(out.root).sync() == 10
    data = meta_json(out.root)
    assert data["similarity"] is None
    newest = index_dir(out.root) / data["shards"][-1]["file"]
    vectors, _ = contents(read_index_file(newest, data["shards"][-1]["count"]))
    np.testing.assert_array_equal(
        vectors[-10:], [out.vectors[("t", 0, o)] for o in range(100, 110)]
    )
    # A rebuild makes it what the segments record.
    IndexStore(out.root).rebuild()
    assert meta_json(out.root)["similarity"] == "dot"
    assert check_index(out.root).similarity == "dot"


def test_index_check_names_the_similarity(tmp_path: Path) -> None:
    out = Output(tmp_path, similarity="manhattan")
    out.segment("t", 0, 0, 9)
    IndexStore(out.root).sync()
    code, report = run_check(out.root)
    assert code == 0 and report["similarity"] == "manhattan"
