"""The chaos harness (scripts/chaos): its check on synthetic outputs, and a few seeds
against a real broker of its own (not the shared one on 9092).

The seeded runs cover the riskiest operations: several workers starting at the same
moment, a worker stalled past its session timeout, a broker restart, and workers
killed or stalled between a batch's dead letters and its publish; and one short seed
in upsert mode (updates, tombstones, re-adds; the current view, then compact --purge).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from chaos import check, chunks, cli, common, long_texts, plans, records, upsert  # noqa: E402

CHAOS_PORT = int(os.environ.get("PIPELINE_CHAOS_TEST_PORT", "19192"))
# Seed i runs scenario i (the plans are short ones): four workers starting at once with a
# SIGKILL and a join; three workers, one SIGSTOPped past the session timeout; a broker
# restart while workers run and another one during the --until-end run; one record in
# eight bad with SIGKILLs and a stall landing between dead letters and publish.
CHAOS_SEEDS = "9,8,11,1"
CHAOS_SCENARIOS = "together,stall,broker-restart,dead-letters"
# Upsert mode, one short seed (about a minute): updates, tombstones and re-adds under
# two SIGKILLs, the current view checked against the topic, then compact --purge.
UPSERT_SEED, UPSERT_SCENARIO = "3", "sigkill"
# Chunk mode, one short seed (about a minute): some 2,000 records, a quarter of them
# long (3-20 KB, English and Chinese) cut into up to ~64 chunks, under two SIGKILLs.
CHUNK_SEED, CHUNK_SCENARIO = "3", "sigkill"


def _good(text: str) -> bytes:
    return json.dumps({"id": "x", "text": text}).encode()


# -- the check, on synthetic outputs (no broker) ------------------------------------------


def test_bad_records_follow_the_contract() -> None:
    rng = random.Random(0)
    for kind, make in records.BAD_MAKERS.items():
        _, value = make(rng, "id-1")
        assert records.is_bad(value), kind
    assert not records.is_bad(_good("hello"))
    assert records.is_bad(None)
    assert records.is_bad(json.dumps({"text": "x" * (common.MAX_TEXT_BYTES + 1)}).encode())


def test_check_counts_lost_doubled_phantom_and_misrouted() -> None:
    real: dict[tuple[int, int], bytes | None] = {
        (0, 0): _good("a"),  # one row: fine
        (0, 1): _good("b"),  # no row: lost
        (0, 2): _good("c"),  # two rows: doubled
        (0, 3): b"{not json",  # dead-lettered: fine
        (0, 4): b"{not json",  # a row and a dead letter: doubled
        (1, 0): _good("d"),  # dead-lettered although good: misrouted
        (1, 1): _good("e"),  # a row with another record's text: mismatched
    }
    rows = [(0, 0, "a"), (0, 2, "c"), (0, 2, "c"), (0, 4, "?"), (1, 1, "zzz"), (1, 5, "aborted")]
    dlq = Counter({(0, 3): 2, (0, 4): 1, (1, 0): 1})
    verdict = check.check_records(real, rows, dlq)
    assert verdict.lost == [(0, 1)]
    assert verdict.doubled == [(0, 2), (0, 4)]
    assert verdict.phantom == [(1, 5)]
    assert verdict.misrouted == [(1, 0)]
    assert verdict.mismatched == [(1, 1)]
    assert verdict.dead_letter_repeats == 1
    assert verdict.bad_records == 2
    assert not verdict.clean


def test_check_index_and_commits() -> None:
    verdict = check.check_records({(0, 0): _good("a"), (0, 1): _good("b")}, [], Counter())
    rows = [(0, 0, "a"), (0, 1, "b")]
    check.check_index(verdict, rows, Counter({(0, 0): 2, (0, 7): 1}))
    assert verdict.index == {"missing": 1, "doubled": 1, "extra": 1}
    check.check_commits(verdict, {0: 2, 1: 3}, {0: 2, 1: 5, 2: 1})
    assert set(verdict.commits_short) == {1, 2}


def test_ranges_and_seeds() -> None:
    assert common.ranges([(0, 1), (0, 2), (0, 3), (0, 7), (2, 5)]) == {0: ["1-3", "7"], 2: ["5"]}
    assert cli.parse_seeds("1-3,7") == [1, 2, 3, 7]


def test_plans_are_seeded_and_cover_every_scenario() -> None:
    for name in plans.SCENARIOS:
        first, again = plans.make_plan(5, name), plans.make_plan(5, name)
        assert [str(s) for s in first.steps] == [str(s) for s in again.steps]
        assert first.steps[0].action == "start"
    assert plans.scenario_for(4, ["stall", "join"], 1) == "join"
    every = range(1, len(plans.SCENARIOS) + 1)
    assert {plans.scenario_for(s, None, 0) for s in every} == set(plans.SCENARIOS)


def test_upsert_contract_and_traffic() -> None:
    rng = random.Random(0)
    for kind, make in records.UPSERT_BAD_MAKERS.items():
        key, value = make(rng, "id-1")
        assert key is not None or value is not None, kind  # kafka-python sends it
        assert records.upsert_verdict(key, value) == (records.BAD, None), kind
    for kind, make in records.BAD_MAKERS.items():
        if kind != "tombstone":  # a tombstone with a key deletes its document
            assert records.upsert_verdict(*make(rng, "id-1"))[0] == records.BAD, kind
    assert records.upsert_verdict(b"doc-1", None) == (records.DELETE, "doc-1")
    assert records.upsert_verdict(b"k", _good("a")) == (records.GOOD, "x")  # the id first
    no_id = json.dumps({"text": "a"}).encode()
    assert records.upsert_verdict(b"doc-2", no_id) == (records.GOOD, "doc-2")
    docs = records.Documents(1, 50)
    items = records.make_upsert_items(rng, docs, records.Ids(1), 1500, 0.03)
    for key, value, bad in items:
        kind, document = records.upsert_verdict(key, value)
        assert bad == (kind == records.BAD)
        if not bad:  # every version and tombstone keyed by its document
            assert key == str(document).encode()
    assert {"inserts", "updates", "deletions", "re-adds"} <= set(docs.counts)
    assert records.key_partition(b"doc-1-7", 3) == records.key_partition(b"doc-1-7", 3)


class _Record:
    def __init__(self, p: int, o: int, key: bytes | None, value: bytes | None) -> None:
        self.partition, self.offset, self.key, self.value, self.timestamp = p, o, key, value, o


def _doc(ident: str, text: str) -> bytes:
    return json.dumps({"id": ident, "text": text}).encode()


def test_upsert_check_counts_documents_view_index_and_purge() -> None:
    topic = "t"
    topic_records = [
        _Record(0, 0, b"a", _doc("a", "a1")),  # superseded by offset 2
        _Record(0, 1, b"b", _doc("b", "b1")),  # deleted at 3
        _Record(0, 2, b"a", _doc("a", "a2")),  # live
        _Record(0, 3, b"b", None),  # the tombstone: a row, deleted
        _Record(0, 4, None, None),  # a tombstone without a key: a dead letter
        _Record(1, 0, b"c", _doc("c", "c1")),  # deleted at 1, re-added at 2
        _Record(1, 1, b"c", None),
        _Record(1, 2, b"c", _doc("c", "c2")),  # live
    ]
    want = upsert.expected(topic_records, topic)
    assert {k: v.text for k, v in want.live.items()} == {"a": "a2", "c": "c2"}
    rows = [(0, 0, "a1"), (0, 1, "b1"), (0, 2, "a2"), (0, 3, ""), (1, 0, "c1"), (1, 1, "")]
    rows += [(1, 2, "c2")]
    flags = [("a", False), ("b", False), ("a", False), ("b", True), ("c", False), ("c", True)]
    scan = check.RowScan(rows=rows, documents=[*flags, ("c", False)])
    verdict, docs = upsert.check_records(want, scan, Counter({(0, 4): 1}))
    assert verdict.clean and docs.clean, (verdict.problems(), docs.problems())
    assert (docs.documents, docs.deletions, docs.updated, docs.readded) == (2, 2, 2, 1)
    # The view: b must be gone, a at its latest version, nothing twice.
    view = [
        {"doc_key": "a", "text": "a1", "topic": topic, "partition": 0, "offset": 0},
        {"doc_key": "b", "text": "b1", "topic": topic, "partition": 0, "offset": 1},
        {"doc_key": "b", "text": "b1", "topic": topic, "partition": 0, "offset": 1},
    ]
    upsert.check_view(docs, want, view, topic)
    assert (docs.view_lost, docs.view_extra, docs.view_stale) == (["c"], ["b"], ["a"])
    assert docs.view_doubled == ["b"]
    # The index: shard files hold every non-deleted row; it serves the live versions.
    held = Counter({(0, 0): 1, (0, 1): 1, (0, 2): 1, (1, 0): 1, (1, 2): 2, (1, 1): 1})
    ids = upsert.IndexIds(held, removed={(0, 0), (1, 0)})
    upsert.check_index(docs, want, scan, ids)
    assert docs.index == {
        "missing": 0, "doubled": 1, "extra": 0, "deleted_rows_indexed": 1,
        "served_not_live": 2, "live_not_served": 0,
    }  # fmt: skip
    # After a purge: superseded and deleted rows erased, their offsets purged.
    kept = check.RowScan(rows=[(0, 2, "a2"), (1, 0, "c1")], documents=[("a", False), ("c", False)])
    kept.purged = [(0, 0), (0, 1), (0, 3), (1, 1), (1, 2)]
    verdict, docs = upsert.check_records(want, kept, Counter({(0, 4): 1}), purged_phase=True)
    assert verdict.clean
    assert docs.left_after_purge == [(1, 0)] and docs.wrongly_purged == [(1, 2)]
    assert docs.stale_texts_left == 1


def test_parquet_rows_reads_upsert_columns_and_purged_offsets(tmp_path: Path) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    vectors = np.zeros((2, 4), dtype=np.float32)
    vectors[0, 0] = 1.0  # a unit vector, and a tombstone's zero vector
    table = pa.table(
        {
            "topic": ["t", "t"],
            "partition": [1, 1],
            "offset": [5, 7],
            "text": ["hello", ""],
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), 4),
            "doc_key": ["a", "b"],
            "deleted": [False, True],
        }
    ).replace_schema_metadata({"segment.purged": "[[6, 6], [2, 3]]"})
    (tmp_path / "vectors").mkdir()
    pq.write_table(table, tmp_path / "vectors" / f"t-p00001-{5:020d}.parquet")
    scan = check.parquet_rows(tmp_path, "t")
    assert scan.rows == [(1, 5, "hello"), (1, 7, "")]
    assert scan.documents == [("a", False), ("b", True)]
    assert sorted(scan.purged) == [(1, 2), (1, 3), (1, 6)] and scan.bad_vectors == 0


def _chunk_segment(path: Path, rows: list[tuple[int, int, int, int, int, int, str]]) -> None:
    """A chunked segment of topic t: rows (partition, offset, chunk, chunk_count,
    char_start, char_end, text), unit vectors."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    vectors = np.zeros((len(rows), 4), dtype=np.float32)
    vectors[:, 0] = 1.0
    columns = list(zip(*rows, strict=True))
    table = pa.table(
        {
            "topic": ["t"] * len(rows),
            "partition": list(columns[0]),
            "offset": list(columns[1]),
            "text": list(columns[6]),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), 4),
            **{
                name: pa.array(list(columns[n]), pa.int32())
                for n, name in enumerate(("chunk", "chunk_count", "char_start", "char_end"), 2)
            },
            "truncated": [False] * len(rows),
            "tokens": pa.array([5] * len(rows), pa.int32()),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def test_chunk_check_finds_incomplete_split_and_wrong_chunks(tmp_path: Path) -> None:
    """A chunked output read back: each record one scan row of its chunks; records with a
    chunk missing, shared out between two segments, or a chunk's text or span wrong
    fail, the per-offset check and the chunk check both; the index is keyed by chunk."""
    text = "alpha beta gamma delta epsilon"
    real = {(0, o): _good(text) for o in range(6)}
    whole = [(0, 0, 0, 3, 0, 16, text[0:16]), (0, 0, 1, 3, 11, 22, text[11:22])]
    whole += [(0, 0, 2, 3, 17, 30, text[17:30])]  # complete, overlapping: fine
    gap = [(0, 1, 0, 2, 0, 10, text[0:10]), (0, 1, 1, 2, 17, 30, text[17:30])]  # "gamma" lost
    missing = [(0, 2, 0, 2, 0, 16, text[0:16])]  # chunk 1 of 2 missing
    split = [(0, 3, 0, 2, 0, 16, text[0:16])]  # chunk 1 in the other segment
    wrong = [(0, 4, 0, 1, 0, 30, text.upper())]  # not the record's text
    single = [(0, 5, 0, 1, 0, 30, text)]  # one chunk: fine
    _chunk_segment(tmp_path / "vectors" / f"t-p00000-{0:020d}.parquet", whole + gap + missing)
    _chunk_segment(tmp_path / "vectors" / f"t-p00000-{3:020d}.parquet", split + wrong + single)
    _chunk_segment(
        tmp_path / "vectors" / f"t-p00000-{9:020d}.parquet", [(0, 3, 1, 2, 11, 30, text[11:30])]
    )
    scan = check.parquet_rows(tmp_path, "t")
    assert len(scan.rows) == 7 and scan.bad_vectors == 0  # a row per record and segment
    verdict = check.check_records(real, scan.rows, Counter())
    assert verdict.doubled == [(0, 3)]
    assert verdict.mismatched == [(0, 1), (0, 2), (0, 4)] and verdict.lost == []
    found = chunks.check_chunks(real, scan.rows, None, tokens=4, overlap=1)
    assert (found.incomplete, found.split) == ([(0, 2), (0, 3), (0, 3)], [(0, 3)])
    assert (found.text, found.spans, found.unchunked) == ([(0, 4)], [(0, 1)], [])
    assert found.rows == 10 and found.records == 6 and found.multi == 2
    assert found.max_chunk_count == 3 and len(found.problems()) > 4
    # The index: one entry per chunk row, ids (partition, offset, chunk).
    index = Counter([(0, o, 0) for o in range(6)] + [(0, 0, 1), (0, 0, 2), (0, 0, 2), (0, 9, 0)])
    check.check_index(verdict, scan.rows, index)  # (0, 1, 1) and (0, 3, 1) not indexed
    assert verdict.index == {"missing": 2, "doubled": 1, "extra": 1}


def test_chunk_mode_texts_are_long_seeded_and_checked_by_tokens(tmp_path: Path) -> None:
    """Chunk mode's corpus: long English and Chinese records within the token budget,
    the same for the same seed; without it, the records are drawn as before; the window
    checks count with the model's tokenizer."""
    from tiny_model import ensure_tiny_model

    model = ensure_tiny_model()
    corpus = long_texts.LongTexts(model, 24, 4)
    assert corpus.has_tokenizer and corpus.budget == 20 * common.MAX_CHUNKS // 2
    rng, rng_again = random.Random(7), random.Random(7)
    drawn = [corpus.text(rng, f"id-{n}") for n in range(400)]
    again = [corpus.text(rng_again, f"id-{n}") for n in range(400)]
    assert [d and d.text for d in drawn] == [d and d.text for d in again]
    long = [d for d in drawn if d is not None and d.kind in long_texts.LONG_KINDS]
    assert long and all(d.text.endswith(")") for d in long)
    sizes = corpus.tokens([d.text for d in long])
    assert max(sizes) <= corpus.budget + 400 and min(sizes) > 4 * 24
    kinds = {d.kind for d in drawn if d is not None}
    assert {"long-english", "medium"} <= kinds
    if corpus.zh:
        assert {"long-chinese", "short-chinese"} <= kinds
    plain = records.good_value(random.Random(3), "a")
    assert plain == records.good_value(random.Random(3), "a", corpus=None)
    # The window checks: a record over N tokens in one chunk, a chunk over N tokens.
    text = " ".join(["lantern"] * 30)
    real = {(0, 0): _good(text), (0, 1): _good("short text")}
    rows: list[tuple[int, int, str]] = [
        (0, 0, check.ChunkedText([(0, 1, 0, len(text), text, False)])),
        (0, 1, check.ChunkedText([(0, 1, 0, 10, "short text", False)])),
    ]
    found = chunks.check_chunks(real, rows, corpus, tokens=24, overlap=4)
    assert (found.uncut, found.oversize, found.overcut) == ([(0, 0)], [(0, 0)], [])
    assert found.long_published == 1 and found.text == found.spans == []


def test_tiny_model_loads_and_embeds(tmp_path: Path) -> None:
    from tiny_model import ensure_tiny_model

    from pipeline.model.embedder import Embedder

    folder = ensure_tiny_model(tmp_path / "tiny")
    assert ensure_tiny_model(folder) == folder  # cached: not rebuilt
    embedder = Embedder.load(str(folder), precision="fp32", device="cpu")
    vectors = embedder.embed(["a short text", "another one, a little longer"])
    assert vectors.shape == (2, 32)
    assert embedder.info.normalize and embedder.info.pooling == "mean"


# -- seeds against a real broker ----------------------------------------------------------


def _run_chaos(tmp_path: Path, seeds: str, scenarios: str, *extra: str) -> tuple[int, str]:
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "chaos"),
            "--seeds",
            seeds,
            "--scenario",
            scenarios,
            "--port",
            str(CHAOS_PORT),
            "--kafka-home",
            str(common.CACHE / "chaos-kafka-test"),
            "--work-dir",
            str(tmp_path / "work"),
            "--json",
            str(tmp_path / "chaos.json"),
            "--keep-going",
            *extra,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.integration
@pytest.mark.slow
def test_chaos_seeds_lose_and_double_nothing(tmp_path: Path) -> None:
    results = tmp_path / "chaos.json"
    returncode, report = _run_chaos(tmp_path, CHAOS_SEEDS, CHAOS_SCENARIOS)
    assert returncode == 0, report
    summary = json.loads(report.split("summary: ", 1)[1].splitlines()[0])
    assert summary["seeds"] == 4 and summary["passed"] == 4, report
    assert summary["lost"] == summary["doubled"] == summary["phantom"] == 0, report
    scenarios = {r["scenario"] for r in json.loads(results.read_text())["results"]}
    assert scenarios == set(CHAOS_SCENARIOS.split(","))


@pytest.mark.integration
@pytest.mark.slow
def test_chaos_upsert_seed_keeps_the_latest_version_of_each_document(tmp_path: Path) -> None:
    returncode, report = _run_chaos(
        tmp_path, UPSERT_SEED, UPSERT_SCENARIO, "--write-mode", "upsert"
    )
    assert returncode == 0, report
    summary = json.loads(report.split("summary: ", 1)[1].splitlines()[0])
    assert summary["passed"] == 1 and summary["purge_failed"] == [], report
    assert summary["view_lost"] == summary["view_extra"] == summary["view_stale"] == 0, report
    (result,) = json.loads((tmp_path / "chaos.json").read_text())["results"]
    documents = result["documents"]
    assert documents["deletions"] and documents["updated"] and documents["readded"], documents
    assert result["purge"]["erased_rows"] and result["purge"]["audit_rc"] == 0


@pytest.mark.integration
@pytest.mark.slow
def test_chaos_chunked_seed_keeps_every_record_whole(tmp_path: Path) -> None:
    """`--chunk-tokens 96 --chunk-overlap 16`: long records cut into many chunks while
    workers are SIGKILLed; every record's chunks complete, in one segment, each its
    record's text[char_start:char_end], indexed once each; the audit exits 0."""
    returncode, report = _run_chaos(
        tmp_path, CHUNK_SEED, CHUNK_SCENARIO, "--chunk-tokens", "96", "--chunk-overlap", "16"
    )
    assert returncode == 0, report
    summary = json.loads(report.split("summary: ", 1)[1].splitlines()[0])
    assert summary["passed"] == 1 and summary["lost"] == summary["doubled"] == 0, report
    assert summary["chunking"] == {"tokens": 96, "overlap": 16}
    (result,) = json.loads((tmp_path / "chaos.json").read_text())["results"]
    found = result["chunks"]
    assert found["multi"] >= 100 and found["max_chunk_count"] >= 20, found
    assert found["long_published"] == found["multi"], found
    assert all(found[k] == 0 for k in chunks.ChunkVerdict.LISTS), found
    assert found["audit_chunk_rows"] == found["rows"] and result["audit"]["rc"] == 0
    assert result["index"] == {"missing": 0, "doubled": 0, "extra": 0}, result["index"]
    assert any(w["killed"] for w in result["workers"].values()), result["workers"]
