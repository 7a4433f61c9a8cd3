"""The embedder on the real default model: input order restored after length
sorting, unit vectors, truncation, padding efficiency and the sub-batch budget,
and parity with sentence-transformers."""

from __future__ import annotations

import importlib.util
import itertools
import random

import numpy as np
import pytest

from pipeline.corpus import sample_texts
from pipeline.embedder import Embedder, EmbedStats, Tokenized


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return sample_texts(512)


def mixed(texts: list[str], n: int = 12) -> list[str]:
    """n texts of very different lengths (the longest tenth left out, to keep the test fast),
    in an order that is not sorted by length."""
    by_len = sorted(texts, key=len)[: len(texts) * 9 // 10]
    picked = [by_len[i * (len(by_len) - 1) // (n - 1)] for i in range(n)]
    random.Random(3).shuffle(picked)
    return picked


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def padding_efficiency(lengths: np.ndarray, chunks: list[slice]) -> float:
    return float(lengths.sum() / sum(int(lengths[c].max()) * len(lengths[c]) for c in chunks))


# ------------------------------------------------------------------ order and norm


def test_embed_tokens_restores_input_order(
    embedder: Embedder, texts: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = mixed(texts, 8)
    # a small budget forces several sub-batches, so rows really are reordered
    monkeypatch.setattr(embedder, "sub_batch_tokens", 128)
    tokens = embedder.tokenize(batch)
    assert not np.all(np.diff(tokens.lengths) >= 0)  # the input is not length-sorted
    vectors, stats = embedder.embed_tokens(tokens)
    assert stats.forward_passes > 1
    alone = np.concatenate([embedder.embed([t]) for t in batch])
    assert vectors.shape == alone.shape == (len(batch), embedder.info.dim)
    assert cosines(vectors, alone).min() > 0.9999
    # and each row is closest to its own text's vector, not a neighbour's
    sims = vectors @ alone.T
    assert (sims.argmax(axis=1) == np.arange(len(batch))).all()


def test_vectors_are_unit_norm(embedder: Embedder, texts: list[str]) -> None:
    assert embedder.info.normalize
    vectors = embedder.embed(texts[:16])
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_duplicate_texts_get_identical_vectors(embedder: Embedder) -> None:
    vectors = embedder.embed(["same sentence here", "a much longer " * 20, "same sentence here"])
    assert cosines(vectors[:1], vectors[2:]).item() > 0.99999


def test_empty_batch(embedder: Embedder) -> None:
    tokens = Tokenized([], np.empty(0, dtype=np.int64), 0)
    vectors, stats = embedder.embed_tokens(tokens)
    assert vectors.shape == (0, embedder.info.dim)
    assert stats.forward_passes == 0


# ------------------------------------------------------------------ truncation


def test_long_text_is_truncated_and_counted(embedder: Embedder, texts: list[str]) -> None:
    long_text = " ".join(texts[:30])
    tokens = embedder.tokenize(["short text", long_text, "another short one"])
    assert embedder.info.max_length == 256
    assert tokens.truncated == 1
    assert tokens.lengths[1] == embedder.info.max_length
    assert tokens.lengths[0] < 10
    vectors, _ = embedder.embed_tokens(tokens)
    assert np.isfinite(vectors).all()


def test_texts_within_limit_are_not_counted_as_truncated(
    embedder: Embedder, texts: list[str]
) -> None:
    tokens = embedder.tokenize(texts[:64])
    assert tokens.lengths.max() <= embedder.info.max_length
    assert tokens.truncated == int((tokens.lengths >= embedder.info.max_length).sum())


# ------------------------------------------------------------------ padding and budget


def test_length_sorting_pads_far_less_than_arrival_order(
    embedder: Embedder, texts: list[str]
) -> None:
    lengths = embedder.tokenize(texts).lengths
    arrival = [slice(i, i + 32) for i in range(0, len(lengths), 32)]
    arrival_eff = padding_efficiency(lengths, arrival)
    ordered = np.sort(lengths, kind="stable")
    sorted_eff = padding_efficiency(ordered, embedder._sub_batches(ordered))
    assert arrival_eff < 0.5
    assert sorted_eff > 2 * arrival_eff


def test_length_sorted_padding_efficiency_is_at_least_90_percent(
    embedder: Embedder, texts: list[str]
) -> None:
    assert embedder.sub_batch_tokens == 8192
    lengths = np.sort(embedder.tokenize(texts).lengths, kind="stable")
    assert padding_efficiency(lengths, embedder._sub_batches(lengths)) >= 0.9


def test_embed_stats_account_real_and_computed_tokens(
    embedder: Embedder, texts: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedder, "sub_batch_tokens", 512)
    tokens = embedder.tokenize(texts[:24])
    _, stats = embedder.embed_tokens(tokens)
    ordered = np.sort(tokens.lengths, kind="stable")
    chunks = embedder._sub_batches(ordered)
    assert stats.real_tokens == tokens.total_tokens
    assert stats.computed_tokens == sum(int(ordered[c].max()) * len(ordered[c]) for c in chunks)
    assert stats.forward_passes == len(chunks)
    assert stats.padding_efficiency == pytest.approx(padding_efficiency(ordered, chunks))
    assert EmbedStats().padding_efficiency == 1.0


@pytest.mark.parametrize("budget", [1, 64, 500, 8192])
def test_sub_batches_respect_the_budget(
    embedder: Embedder, budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedder, "sub_batch_tokens", budget)
    rng = np.random.default_rng(budget)
    lengths = np.sort(rng.integers(1, 300, size=400), kind="stable")
    chunks = embedder._sub_batches(lengths)
    # contiguous, in order, covering every row once
    assert chunks[0].start == 0 and chunks[-1].stop == len(lengths)
    assert all(a.stop == b.start for a, b in itertools.pairwise(chunks))
    for c in chunks:
        n = c.stop - c.start
        assert n >= 1
        assert int(lengths[c].max()) * n <= budget or n == 1
    assert embedder._sub_batches(lengths[:0]) == []


# ------------------------------------------------------------------ parity


@pytest.mark.skipif(
    importlib.util.find_spec("sentence_transformers") is None,
    reason="sentence-transformers is not installed",
)
def test_vectors_match_sentence_transformers(embedder: Embedder, texts: list[str]) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(embedder.info.path, device="cpu", local_files_only=True)
    batch = [*mixed(texts, 8), " ".join(texts[:30])]  # includes a truncated text
    expected = reference.encode(batch, convert_to_numpy=True, normalize_embeddings=False)
    got = embedder.embed(batch)
    assert cosines(got, expected).min() > 0.9999
