"""The bounded set of forward-pass shapes: every pass is in it, whatever the batches."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pipeline.model.shapes import MIN_PASS_ROWS, PADDING_TARGET, ShapePlan, pass_defaults


def test_widths_round_up_to_a_few_buckets_per_octave() -> None:
    plan = ShapePlan(8192, 256)
    assert [plan.width_of(n) for n in (1, 4, 5, 9, 31, 33, 65, 100, 129, 250, 256)] == [
        4,
        4,
        8,
        12,
        32,
        36,
        72,
        104,
        144,
        256,
        256,
    ]
    for length in range(1, 257):
        width = plan.width_of(length)
        assert length <= width <= 256
        assert width - length < max(4, width / 8)  # padding: 3 tokens, or an eighth


def test_row_counts_are_a_short_ladder_under_the_budgets() -> None:
    plan = ShapePlan(8192, 256)
    assert plan.row_counts(64) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
    # past 64 tokens attention's rows x width^2 bounds the rows, not the token budget
    assert plan.row_counts(100) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 52)
    assert plan.row_counts(256) == (1, 2, 3, 4, 6, 8)
    assert ShapePlan(1, 256).row_counts(64) == (1,)


def test_attention_scores_stay_bounded_at_every_width() -> None:
    plan = ShapePlan(8192, 512)
    for _, width in plan.shapes():
        rows = plan.max_rows(width)
        assert rows * width <= 8192 or rows == 1
        assert rows * width * width <= 8192 * 64 or rows == 1


def test_the_set_of_shapes_is_small_and_fixed() -> None:
    shapes = ShapePlan(8192, 256).shapes()
    assert len(shapes) == len(set(shapes)) < 600
    assert all(rows * width <= 8192 or rows == 1 for rows, width in shapes)
    assert all(rows * width * width <= 8192 * 64 or rows == 1 for rows, width in shapes)


@pytest.mark.parametrize("seed", range(5))
def test_any_stream_of_batches_stays_inside_the_set(seed: int) -> None:
    """The point of buckets: a stream of batches of any size and mix of lengths meets
    no shape outside `shapes()`, where exact shapes keep meeting new ones."""
    rng = np.random.default_rng(seed)
    bucketed, exact = ShapePlan(8192, 256), ShapePlan(8192, 256, exact=True)
    allowed = set(bucketed.shapes())
    seen_bucketed: set[tuple[int, int]] = set()
    seen_exact: set[tuple[int, int]] = set()
    for _ in range(300):
        size = int(rng.integers(1, 600))
        lengths = np.sort(np.minimum(rng.lognormal(3.2, 0.8, size).astype(int) + 1, 256))
        for plan, seen in ((bucketed, seen_bucketed), (exact, seen_exact)):
            passes = plan.plan(lengths)
            assert passes[0].rows.start == 0 and passes[-1].rows.stop == size
            assert all(a.rows.stop == b.rows.start for a, b in itertools.pairwise(passes))
            seen |= {(p.count, p.width) for p in passes}
    assert seen_bucketed <= allowed
    assert len(seen_exact) > 2 * len(seen_bucketed)


def test_a_pass_keeps_the_spread_of_lengths_small() -> None:
    lengths = np.array([10] * 20 + [40] * 20)
    passes = ShapePlan(8192, 256).plan(lengths)
    for p in passes:
        rows = lengths[p.rows]
        if p.count > MIN_PASS_ROWS:
            assert rows.min() == rows.max()


def test_exact_plan_pads_to_the_longest_row_only() -> None:
    lengths = np.array([3, 5, 7, 7])
    [one] = ShapePlan(8192, 256, exact=True).plan(lengths)
    assert (one.count, one.width) == (4, 7)


def test_pass_defaults_follow_the_device_and_the_model_width() -> None:
    minilm = 1536 * 4  # feed-forward width x fp32 bytes
    assert pass_defaults("cpu", minilm) == (2048, PADDING_TARGET)
    wide = pass_defaults("cpu", 3072 * 4)[0]  # a base-size model: half the tokens
    assert wide == 1024
    assert pass_defaults("cpu", 64 * 4)[0] == 49_152  # a tiny model: far fuller passes
    assert pass_defaults("cpu", 1)[0] == 65_536  # bounded both ways
    assert pass_defaults("cpu", 1 << 30)[0] == 256
    assert pass_defaults("cuda", minilm) == (131_072, 0.6)
