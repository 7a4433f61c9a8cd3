"""Forward-pass shapes: a bounded set, so a long-running worker pays per-shape costs once.

On the CPU every new (rows, width) of a forward pass costs once: oneDNN creates and
caches primitives (and their scratch memory) per shape, the allocator keeps buffers
of every size it has seen. With exact shapes, a worker meets a new shape on most
batches, and its memory grows with the variety of text lengths it has embedded.
Here widths are rounded up to a few buckets per octave and row counts come from a
short geometric ladder, so the set of shapes is small and fixed by the token budget
and the model's maximum length; `ShapePlan.shapes()` lists it.

Passes are cut from a length-sorted batch, longest first: a pass grows while its
padded size stays under the token budget and its rows' real tokens stay a large
share of its longest row times its rows (the spread of lengths inside a pass); then
it is trimmed to the largest row count on the ladder. Width rounding adds padding
of its own (at most 3 tokens up to 32, an eighth of the width above): on the
bench corpus 7 % more computed tokens than exact widths, measured against the time
exact shapes cost by `scripts/hotpath.py shapes`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

import numpy as np

# Real tokens / (longest x rows) a pass keeps: without it one pass would span
# lengths 9..26 and waste a third of its work on padding.
PADDING_TARGET = 0.92
# Per device: padded tokens per pass and the padding target. A GPU pays a fixed
# cost per pass (kernel launches from Python), so there fewer, fuller passes win
# over less padding (`scripts/gpu-check.sh`; docs/performance.md, GPU).
CUDA_PASS_TOKENS = 131_072
CUDA_PADDING_TARGET = 0.6
# On the CPU the pass's work dominates and padding is pure loss; what bounds a
# pass is its activations, so its tokens follow the model's width: the widest
# activation (the feed-forward layer's) stays under this many bytes per pass: larger
# passes made a worker's peak memory grow with its backlog, for no speed
# (docs/performance.md). A tiny model gets far more tokens per pass: there the
# per-pass Python overhead dominates.
CPU_PASS_ACTIVATION_BYTES = 12 << 20
CPU_PASS_TOKENS = (256, 65_536)


def pass_defaults(device: str, activation_bytes_per_token: int) -> tuple[int, float]:
    """(token budget, padding target) for passes on this device ("cpu" or "cuda"),
    for a model whose widest activation takes this many bytes per token."""
    if device == "cuda":
        return CUDA_PASS_TOKENS, CUDA_PADDING_TARGET
    low, high = CPU_PASS_TOKENS
    tokens = CPU_PASS_ACTIVATION_BYTES // max(1, activation_bytes_per_token)
    return max(low, min(high, tokens)), PADDING_TARGET


# Up to this many rows a pass is not cut for padding: tiny passes waste more than padding.
MIN_PASS_ROWS = 8
# Widths are multiples of MIN_WIDTH_STEP, and each octave has at most BUCKETS_PER_OCTAVE.
MIN_WIDTH_STEP = 4
BUCKETS_PER_OCTAVE = 8
# Passes wider than this many tokens get fewer rows than the token budget allows:
# rows x width^2 <= token budget x ATTENTION_WIDTH bounds attention's scores.
ATTENTION_WIDTH = 64


@dataclass(frozen=True)
class Pass:
    """One forward pass: rows of the length-sorted batch, padded to `width` tokens."""

    rows: slice
    width: int

    @property
    def count(self) -> int:
        return self.rows.stop - self.rows.start

    @property
    def computed_tokens(self) -> int:
        return self.count * self.width


class ShapePlan:
    """Cuts length-sorted batches into passes of bucketed shapes under a token budget."""

    def __init__(
        self,
        token_budget: int,
        max_length: int,
        exact: bool = False,
        padding_target: float = PADDING_TARGET,
    ) -> None:
        """`exact`: widths and row counts as the batch has them (unbounded shapes),
        for measuring what the buckets cost and save. `padding_target`: the share of
        real tokens a pass keeps as it grows (lower: fewer, larger passes)."""
        if token_budget < 1 or max_length < 1:
            raise ValueError("token budget and max length must be positive")
        self.token_budget = token_budget
        self.max_length = max_length
        self.exact = exact
        self.padding_target = padding_target
        # Attention holds rows x heads x width^2 scores: under the token budget alone
        # a pass of long rows held far more than its activations, and a worker's
        # peak memory grew with how full its long passes were.
        self.attention_budget = token_budget * ATTENTION_WIDTH

    def max_rows(self, width: int) -> int:
        """The most rows a pass of this width may have under both budgets."""
        return max(1, min(self.token_budget // width, self.attention_budget // (width * width)))

    def width_of(self, length: int) -> int:
        """The bucket a row of `length` tokens is padded to."""
        length = max(1, length)
        return length if self.exact else _bucket(length, self.max_length)

    def row_counts(self, width: int) -> tuple[int, ...]:
        """Row counts a pass of this width may have, ascending."""
        most = self.max_rows(width)
        return tuple(range(1, most + 1)) if self.exact else _ladder(most)

    def _trim(self, rows: int, width: int) -> int:
        """The largest allowed row count up to `rows`."""
        if self.exact:
            return rows
        counts = self.row_counts(width)
        return counts[bisect.bisect_right(counts, rows) - 1]

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, width) a pass can have: the whole set, for warm-up and tests."""
        widths = sorted({self.width_of(n) for n in range(1, self.max_length + 1)})
        return [(rows, width) for width in widths for rows in self.row_counts(width)]

    def plan(self, sorted_lengths: np.ndarray) -> list[Pass]:
        """Passes covering every row once, in ascending row order."""
        lengths = sorted_lengths.tolist()
        passes: list[Pass] = []
        end = len(lengths)
        while end > 0:
            longest = lengths[end - 1]
            width = self.width_of(longest)
            most = min(self.max_rows(width), end)
            grown = _grow(lengths, end, longest, most, self.padding_target)
            rows = self._trim(grown, width)
            passes.append(Pass(slice(end - rows, end), width))
            end -= rows
        passes.reverse()
        return passes


def _grow(lengths: list[int], end: int, longest: int, most: int, target: float) -> int:
    """How many rows, ending at `end`, keep the pass's spread of lengths small."""
    rows, real = 1, longest
    while rows < most:
        following = lengths[end - 1 - rows]
        if rows + 1 > MIN_PASS_ROWS and real + following < target * longest * (rows + 1):
            break
        real += following
        rows += 1
    return rows


@cache
def _bucket(length: int, max_length: int) -> int:
    if length >= max_length:
        return length  # only reached by rows at the model's limit
    step = max(MIN_WIDTH_STEP, 1 << max(0, length.bit_length() - 1 - _octave_bits()))
    return min(-(-length // step) * step, max_length)


def _octave_bits() -> int:
    return BUCKETS_PER_OCTAVE.bit_length() - 1


@cache
def _ladder(most: int) -> tuple[int, ...]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... below `most`, then `most` itself."""
    counts = {most}
    power = 1
    while power < most:
        counts.add(power)
        if power * 3 // 2 < most and power >= 2:
            counts.add(power * 3 // 2)
        power *= 2
    return tuple(sorted(counts))


def sorted_batches(
    rows: list[list[int]], pad: int, size: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Token-id rows sorted by length and cut `size` at a time, each batch right-padded
    (`right_padded`): little padding for calibration and measurement passes."""
    ordered = sorted(rows, key=len)
    for start in range(0, len(ordered), size):
        yield right_padded(ordered[start : start + size], pad)


def right_padded(rows: list[list[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    """int64 ids and mask of token-id rows, right-padded to the longest."""
    width = max(map(len, rows))
    ids = np.array([r + [pad] * (width - len(r)) for r in rows], dtype=np.int64)
    mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=np.int64)
    return ids, mask
