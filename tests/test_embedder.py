"""The embedder on the real default model: input order restored after length
sorting, unit vectors, truncation, padding efficiency and the sub-batch budget,
and parity with sentence-transformers."""

from __future__ import annotations

import importlib.util
import itertools
import random
import time

import numpy as np
import pytest

import pipeline.model.embedder as embedder_mod
from pipeline.core.corpus import sample_texts
from pipeline.core.host import CpuPlan
from pipeline.model.embedder import (
    TRIM_AFTER_BYTES,
    Embedder,
    EmbedStats,
    Tokenized,
    activation_bytes_per_token,
)
from pipeline.model.shapes import Pass, ShapePlan, pass_defaults


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


def padding_efficiency(lengths: np.ndarray, passes: list[Pass]) -> float:
    return float(lengths.sum() / sum(p.computed_tokens for p in passes))


def arrival_passes(lengths: np.ndarray, size: int) -> list[Pass]:
    """Batches in arrival order, each padded to its longest row."""
    return [
        Pass(slice(i, i + size), int(lengths[i : i + size].max()))
        for i in range(0, len(lengths), size)
    ]


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


def test_a_batch_of_mixed_token_id_kinds_embeds_as_lists_do(embedder: Embedder) -> None:
    """A batch joins polls tokenized here (lists) and in the tokenizer process (int32
    memoryviews), or arrays: gathered end to end, the vectors are the same."""
    lists = embedder.tokenize(["short", "a longer text with more words in it", "mid size one"])
    as_lists, _ = embedder.embed_tokens(lists)
    views = [memoryview(np.asarray(ids, dtype=np.int32)) for ids in lists.ids]
    arrays = [np.asarray(ids, dtype=np.int64) for ids in lists.ids]
    for rows in (views, arrays, [lists.ids[0], views[1], arrays[2]]):
        mixed, _ = embedder.embed_tokens(Tokenized(rows, lists.lengths, 0))
        np.testing.assert_array_equal(mixed, as_lists)


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
    arrival_eff = padding_efficiency(lengths, arrival_passes(lengths, 32))
    ordered = np.sort(lengths, kind="stable")
    sorted_eff = padding_efficiency(ordered, embedder.shape_plan.plan(ordered))
    assert arrival_eff < 0.5
    assert sorted_eff > 1.7 * arrival_eff


def test_length_sorted_padding_efficiency_with_bucketed_shapes(
    embedder: Embedder, texts: list[str]
) -> None:
    """Bucketed widths cost a few points of padding against exact ones, no more."""
    assert embedder.sub_batch_tokens == 2048  # MiniLM: 1536 x 4 bytes per token, 12 MiB
    lengths = np.sort(embedder.tokenize(texts).lengths, kind="stable")
    plan = embedder.shape_plan
    bucketed = padding_efficiency(lengths, plan.plan(lengths))
    plan.exact = True
    exact = padding_efficiency(lengths, plan.plan(lengths))
    assert exact >= 0.9
    assert bucketed >= 0.85
    assert bucketed >= exact - 0.08


def test_embed_stats_account_real_and_computed_tokens(
    embedder: Embedder, texts: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedder, "sub_batch_tokens", 512)
    tokens = embedder.tokenize(texts[:24])
    _, stats = embedder.embed_tokens(tokens)
    ordered = np.sort(tokens.lengths, kind="stable")
    passes = embedder.shape_plan.plan(ordered)
    assert stats.real_tokens == tokens.total_tokens
    assert stats.computed_tokens == sum(p.computed_tokens for p in passes)
    assert stats.forward_passes == len(passes)
    assert stats.padding_efficiency == pytest.approx(padding_efficiency(ordered, passes))
    assert EmbedStats().padding_efficiency == 1.0


@pytest.mark.parametrize("budget", [1, 64, 500, 8192])
def test_sub_batches_respect_the_budget(
    embedder: Embedder, budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedder, "sub_batch_tokens", budget)
    rng = np.random.default_rng(budget)
    lengths = np.sort(rng.integers(1, 257, size=400), kind="stable")
    passes = embedder.shape_plan.plan(lengths)
    # contiguous, in order, covering every row once
    assert passes[0].rows.start == 0 and passes[-1].rows.stop == len(lengths)
    assert all(a.rows.stop == b.rows.start for a, b in itertools.pairwise(passes))
    shapes = set(embedder.shape_plan.shapes())
    for p in passes:
        assert p.count >= 1
        assert p.width >= int(lengths[p.rows].max())
        assert p.computed_tokens <= budget or p.count == 1
        assert (p.count, p.width) in shapes
    assert embedder.shape_plan.plan(lengths[:0]) == []


def test_replicas_give_the_same_vectors_as_one(embedder: Embedder, texts: list[str]) -> None:
    two = embedder.with_replicas(2, 1)
    try:
        tokens = embedder.tokenize(texts[:200])
        one_vectors, _ = embedder.embed_tokens(tokens)
        two_vectors, stats = two.embed_tokens(tokens)
    finally:
        two.close()
    assert stats.forward_passes > 2  # several passes, so both replicas ran some
    assert cosines(one_vectors, two_vectors).min() > 0.99999


def test_work_between_passes_runs_with_each_replica_one_pass_ahead(
    embedder: Embedder, texts: list[str]
) -> None:
    two = embedder.with_replicas(2, 1)
    tokens = embedder.tokenize(texts[:200])
    started: list[int] = []
    outstanding: list[int] = []

    def between() -> None:
        # Work done here (a nearline batch) must not wait behind the whole batch:
        # at most `replicas` passes of it are out when this runs.
        outstanding.append(two._pool._work_queue.qsize())
        started.append(len(started))
        embedded, _ = two.embed_tokens(embedder.tokenize(texts[:3]))  # urgent work, nested
        assert embedded.shape == (3, two.info.dim)
        time.sleep(0.002)

    try:
        plain, _ = two.embed_tokens(tokens)
        yielded, stats = two.embed_tokens(tokens, between_passes=between)
    finally:
        two.close()
    assert len(started) == stats.forward_passes > 2
    assert max(outstanding) <= 2
    assert stats.yielded_s >= 0.002 * stats.forward_passes
    assert cosines(plain, yielded).min() > 0.99999  # rows still in input order


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


def test_tokenizing_on_several_threads_keeps_order_and_counts(
    embedder: Embedder, texts: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    many = [*texts, " ".join(texts[:40]), *texts, *texts]  # one long text, truncated
    monkeypatch.setattr(embedder, "tokenizer_threads", 1)
    serial = embedder.tokenize(many)
    monkeypatch.setattr(embedder, "tokenizer_threads", 3)
    parallel = embedder.tokenize(many)
    assert parallel.ids == serial.ids
    assert (parallel.lengths == serial.lengths).all()
    assert parallel.truncated == serial.truncated >= 1


def test_planned_load_takes_the_plan_and_its_device_defaults(texts: list[str]) -> None:
    planned = Embedder.load_planned("default", "fp32", CpuPlan(2, 1, 3, "cpu"))
    try:
        assert (planned.replicas, planned.tokenizer_threads) == (2, 3)
        expected = pass_defaults("cpu", activation_bytes_per_token(planned._model))
        assert (planned.sub_batch_tokens, planned.padding_target) == expected
        assert planned.embed(texts[:8]).shape == (8, planned.info.dim)
    finally:
        planned.close()
    given = Embedder.load_planned("default", "fp32", CpuPlan(1, 1), 1024, exact_shapes=True)
    assert (given.sub_batch_tokens, given.exact_shapes) == (1024, True)
    given.close()


def test_fewer_fuller_passes_under_a_lower_padding_target(embedder: Embedder) -> None:
    lengths = np.sort(np.array([len(t) % 97 + 3 for t in sample_texts(2000)]))
    tight = ShapePlan(131_072, 256, padding_target=0.92).plan(lengths)
    loose = ShapePlan(131_072, 256, padding_target=0.6).plan(lengths)
    assert len(loose) < len(tight)
    assert padding_efficiency(lengths, loose) >= 0.6 * 0.9
    for plan in (tight, loose):
        assert sum(p.count for p in plan) == len(lengths)


def test_free_pages_go_back_after_big_passes_only(
    embedder: Embedder, texts: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trims: list[int] = []
    monkeypatch.setattr(embedder_mod, "release_free_memory", lambda: trims.append(1))
    tokens = embedder.tokenize(texts[:200])
    _, stats = embedder.embed_tokens(tokens)
    big = TRIM_AFTER_BYTES // activation_bytes_per_token(embedder._model)
    expected = embedder.shape_plan.plan(np.sort(tokens.lengths))
    assert len(trims) == sum(1 for p in expected if p.computed_tokens >= big)
    assert 0 < len(trims) < stats.forward_passes  # MiniLM: big passes trim, small ones not
