"""Chunking long texts (pipeline.model.chunking) and what rows say of their text: the
windows, the spans, the flags, batches that keep a record's chunks together, the
segment columns and the output's refusals. No broker: tests/test_chunking_worker.py
runs the worker."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from consumers.batcher import Batcher, CloseReason
from pipeline.core.chunks import CHUNKED, FLAGGED, PLAIN, TOO_MANY_CHUNKS, Chunking, Span
from pipeline.core.config import WorkerConfig
from pipeline.core.errors import ConfigError, OutputError
from pipeline.core.layout import SegmentKey
from pipeline.core.model_info import ModelInfo
from pipeline.core.records import BadRecord, GoodRecord, SourceRecord
from pipeline.model.chunking import Chunker, token_windows
from sinks.identity import check_output_rows
from sinks.parquet import ParquetSink

MAX_LENGTH = 256
ENGLISH = (
    "Kafka consumers read records in micro-batches. Each batch is embedded by a "
    "transformer and written to Parquet; offsets are committed only once the files are "
    "durable, so a restarted worker picks up exactly where the outputs end. "
)
CHINESE = "长文档需要切分成多个片段，每个片段单独生成向量，然后按文档汇总检索结果。"


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    from pipeline.model.spec import ModelSpec

    return str(ModelSpec.read("default", None, None, None).tokenizer.backend(None).to_str())


def chunker(tokenizer_json: str, tokens: int = 64, overlap: int = 8, **kwargs: object) -> Chunker:
    return Chunker(tokenizer_json, MAX_LENGTH, "", Chunking(tokens, overlap, **kwargs))  # type: ignore[arg-type]


# -- windows ------------------------------------------------------------------------


def test_a_text_within_the_window_is_not_cut() -> None:
    assert token_windows(list(range(10)), 10, 2) is None


@pytest.mark.parametrize("n,window,overlap", [(11, 10, 0), (100, 10, 3), (1000, 64, 16)])
def test_windows_cover_every_token_with_the_overlap_asked(
    n: int, window: int, overlap: int
) -> None:
    windows = token_windows(list(range(n)), window, overlap)  # every token its own word
    assert windows is not None and windows[0][0] == 0 and windows[-1][1] == n
    for (start, end), (next_start, _) in itertools.pairwise(windows):
        assert 0 < end - start <= window
        assert end - next_start == overlap  # exactly M shared where words are single tokens


def test_windows_do_not_cut_words_where_a_boundary_is_within_reach() -> None:
    rng = random.Random(3)
    word_ids: list[int | None] = []
    for word in range(400):
        word_ids += [word] * rng.randint(1, 4)  # words of 1 to 4 tokens
    windows = token_windows(word_ids, 32, 6)
    assert windows is not None
    for start, end in windows:
        assert end - start <= 32
        assert start == 0 or word_ids[start] != word_ids[start - 1]
        assert end == len(word_ids) or word_ids[end] != word_ids[end - 1]


def test_a_run_without_word_boundaries_is_cut_between_tokens() -> None:
    windows = token_windows([0] * 100, 30, 5)  # one "word" of 100 tokens
    assert windows is not None and windows[-1][1] == 100
    assert all(0 < end - start <= 30 for start, end in windows)


# -- spans of real text -------------------------------------------------------------


@pytest.mark.parametrize("text", [ENGLISH * 12, CHINESE * 20, (ENGLISH + CHINESE) * 8])
def test_spans_are_exact_substrings_within_the_window(tokenizer_json: str, text: str) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    cut = chunker(tokenizer_json, 64, 8)
    spans = cut.spans(text)
    assert spans is not None and len(spans) > 2
    assert [s.chunk for s in spans] == list(range(len(spans)))
    assert {s.chunk_count for s in spans} == {len(spans)}
    for span in spans:
        chunk = text[span.char_start : span.char_end]
        assert chunk == chunk.strip() and chunk
        assert len(tokenizer.encode(chunk, add_special_tokens=False).ids) <= 64
    # Neighbours overlap, and together they hold every non-space character.
    assert all(b.char_start < a.char_end for a, b in itertools.pairwise(spans))
    assert spans[0].char_start == 0 and spans[-1].char_end == len(text.rstrip())


def test_a_window_past_the_model_length_is_a_usage_error(tokenizer_json: str) -> None:
    with pytest.raises(ConfigError, match="at most 254"):
        chunker(tokenizer_json, 255, 0)
    chunker(tokenizer_json, 254, 0)  # the model's 256 less [CLS] and [SEP]


def _shape(cut: Chunker, texts: list[str]) -> object:
    encode = cut._tokenizer.encode_batch  # the worker's own: prompt and specials, capped

    def tokenize(batch: list[str]) -> list[list[int]]:
        return [e.ids[:MAX_LENGTH] for e in encode(batch, add_special_tokens=True)]

    ids = tokenize(texts)
    full = [len(e.ids) for e in encode(texts, add_special_tokens=True)]
    truncated = sum(n > MAX_LENGTH for n in full)
    return cut.shape(texts, [len(i) for i in ids], truncated, tokenize), ids


def test_records_past_max_chunks_are_dead_lettered_or_truncated(tokenizer_json: str) -> None:
    texts = ["short one", ENGLISH * 12]
    sources = [SourceRecord("t", 0, n, 0, None, b"{}") for n in range(2)]
    parsed = [GoodRecord(s, t, None, None) for s, t in zip(sources, texts, strict=True)]

    shaped, ids = _shape(chunker(tokenizer_json, 64, 8, max_chunks=3), texts)  # type: ignore[misc]
    rows = shaped.records(parsed)
    assert rows[0] == parsed[0] and isinstance(rows[1], BadRecord)
    assert rows[1].error_class == TOO_MANY_CHUNKS and "over --max-chunks 3" in rows[1].message
    assert len(shaped.row_ids(ids)) == 1

    cut = chunker(tokenizer_json, 64, 8, max_chunks=3, overflow="truncate")
    shaped, ids = _shape(cut, texts)  # type: ignore[misc]
    rows = shaped.records(parsed)
    assert len(rows) == 4 and len(shaped.row_ids(ids)) == 4
    assert [r.span.chunk for r in rows[1:]] == [0, 1, 2]
    assert all(r.span.chunk_count == 3 and r.span.truncated for r in rows[1:])
    assert all(r.text == texts[1][r.span.char_start : r.span.char_end] for r in rows[1:])


def test_without_chunking_rows_say_which_texts_the_model_cut(tokenizer_json: str) -> None:
    cut = Chunker(tokenizer_json, MAX_LENGTH, "", None)
    exact = " ".join(["word"] * (MAX_LENGTH - 2))  # exactly the model's length: not cut
    texts = ["short", exact, ENGLISH * 20]
    shaped, _ = _shape(cut, texts)  # type: ignore[misc]
    assert shaped.truncated == 1 and list(shaped.spans) == [2]
    assert shaped.spans[2] == [Span(0, 1, 0, len(texts[2]), truncated=True)]


# -- batches keep a record's chunks together -----------------------------------------


def test_a_records_chunks_close_a_batch_together() -> None:
    rows = []
    for offset in range(6):
        source = SourceRecord("t", 0, offset, 0, None, b"x" * 100)
        count = 1 + offset % 3
        for chunk in range(count):
            span = Span(chunk, count, chunk * 10, chunk * 10 + 10)
            rows.append((GoodRecord(source, "chunk", None, None, span), [1, 2, 3]))
    batcher = Batcher(2, 5, 1.0, max_bytes=150)  # every bound smaller than a record
    closed = batcher.add(rows, lambda key: 0)
    closed.append(batcher.flush(CloseReason.SHUTDOWN))
    seen = []
    for batch in closed:
        if batch is None:
            continue
        offsets = [g.source.offset for g in batch.good]
        for offset in set(offsets):  # all of a record's rows, in chunk order
            chunks = [g.span.chunk for g in batch.good if g.source.offset == offset]
            assert chunks == list(range(1 + offset % 3))
        seen += sorted(set(offsets))
        # Ranges cover the records, and bytes count a record's value once.
        assert batch.ranges[("t", 0)] == [min(offsets), max(offsets)]
        assert batch.value_bytes == 100 * len(set(offsets))
    assert seen == list(range(6))


# -- segment columns and the output's refusals ----------------------------------------

MODEL = ModelInfo("m", "/models/m", "sha256:abc", 4, "mean", True, MAX_LENGTH, "fp32", "cpu")


def _stage(sink: ParquetSink, records: list[GoodRecord], first: int, last: int) -> Path:
    sink.prepare()
    vectors = np.ones((len(records), 4), np.float32)
    staged = sink.stage(
        SegmentKey("t", 0, first),
        last,
        records,
        vectors,
        consumed=last - first + 1,
        tokens=[7] * len(records),
    )
    assert sink.publish(staged)
    assert staged.final_path is not None
    return staged.final_path


def test_chunked_segments_hold_the_span_columns(tmp_path: Path) -> None:
    chunking = Chunking(64, 8)
    source = SourceRecord("t", 0, 0, 0, b"k", b"{}")
    text = "alpha beta gamma"
    records = [
        GoodRecord(source, "alpha beta", "d", None, Span(0, 2, 0, 10)),
        GoodRecord(source, "beta gamma", "d", None, Span(1, 2, 6, 16)),
    ]
    path = _stage(ParquetSink(tmp_path, MODEL, rows=CHUNKED, chunking=chunking), records, 0, 0)
    table = pq.read_table(path)
    assert table.column_names[9:] == [
        "chunk", "chunk_count", "char_start", "char_end", "truncated", "tokens",
    ]  # fmt: skip
    rows = table.to_pylist()
    assert [text[r["char_start"] : r["char_end"]] for r in rows] == [r["text"] for r in rows]
    assert [r["chunk"] for r in rows] == [0, 1] and {r["tokens"] for r in rows} == {7}
    assert table.schema.metadata[b"chunking.tokens"] == b"64"
    assert check_output_rows(tmp_path, chunking) == CHUNKED
    with pytest.raises(OutputError, match="--chunk-tokens 64 --chunk-overlap 8"):
        check_output_rows(tmp_path, Chunking(128, 8))
    with pytest.raises(OutputError, match="--chunk-tokens 64"):
        check_output_rows(tmp_path, None)


def test_whole_record_outputs_refuse_chunks_and_old_ones_keep_their_columns(
    tmp_path: Path,
) -> None:
    assert check_output_rows(tmp_path / "new", None) == FLAGGED
    assert check_output_rows(tmp_path / "new", Chunking(64)) == CHUNKED
    source = SourceRecord("t", 0, 0, 0, None, b"{}")
    record = GoodRecord(source, "whole", None, None)
    old = tmp_path / "old"
    path = _stage(ParquetSink(old, MODEL, rows=PLAIN), [record], 0, 0)
    assert "truncated" not in pq.read_schema(path).names
    assert check_output_rows(old, None) == PLAIN
    flagged = tmp_path / "flagged"
    path = _stage(ParquetSink(flagged, MODEL), [record], 0, 0)
    row = pq.read_table(path).to_pylist()[0]
    assert row["truncated"] is False and row["tokens"] == 7
    with pytest.raises(OutputError, match="whole records"):
        check_output_rows(flagged, Chunking(64))


# -- configuration --------------------------------------------------------------------


@pytest.mark.parametrize(
    "options,message",
    [
        ({"chunk_tokens": 64, "chunk_overlap": 64}, "must be smaller than --chunk-tokens"),
        ({"chunk_overlap": 8}, "needs --chunk-tokens"),
        ({"chunk_tokens": 64, "max_chunks": 257}, "--max-chunks must be 1 to 256"),
        ({"chunk_tokens": 0}, "chunk tokens must be positive"),
        ({"chunk_tokens": 64, "chunk_overflow": "drop"}, "chunk overflow"),
    ],
)
def test_bad_chunk_options_are_usage_errors(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        WorkerConfig.of(("t",), "g", Path("/tmp/out"), **options)
    assert raised.value.exit_code == 64


def test_the_chunking_setting_reaches_the_config() -> None:
    config = WorkerConfig.of(("t",), "g", Path("/tmp/out"), chunk_tokens=128, chunk_overlap=16)
    assert config.chunking == Chunking(128, 16, 128, "dead-letter")
    assert WorkerConfig.of(("t",), "g", Path("/tmp/out")).chunking is None


def test_the_record_bound_counts_records_not_chunks() -> None:
    """A poll of chunked records closes no more batches than one of whole records: the
    poll loop hands every batch a poll closes to a queue of bounded room."""
    rows = []
    for offset in range(8):
        source = SourceRecord("t", 0, offset, 0, None, b"{}")
        for chunk in range(10):
            span = Span(chunk, 10, chunk * 10, chunk * 10 + 10)
            rows.append((GoodRecord(source, "chunk", None, None, span), [1, 2, 3]))
    batcher = Batcher(4, 10_000, 1.0)
    closed = batcher.add(rows, lambda key: 0)
    assert [b.records for b in closed] == [4, 4]
    assert [len(b.good) for b in closed] == [40, 40]
