"""Offset ranges: sorted, disjoint `(first, last)` pairs and the helpers the audit needs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from pipeline.core.layout import TopicPartitionKey

Key = TopicPartitionKey
Range = tuple[int, int]  # first and last offset, both included

_RANGE_LIMIT = 8  # ranges shown per cell in the human table

EMPTY = np.empty(0, dtype=np.int64)


def runs(offsets: np.ndarray) -> list[Range]:
    """Sorted, distinct offsets as ranges of consecutive offsets."""
    if offsets.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(offsets) != 1)
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks, [offsets.size - 1]))
    return [(int(offsets[s]), int(offsets[e])) for s, e in zip(starts, ends, strict=True)]


def merge(ranges: Iterable[Range], within: int = 0) -> list[Range]:
    """Sorted, disjoint ranges; overlapping or touching ones (or closer than `within`) joined."""
    merged: list[Range] = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1] + 1 + within:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return merged


def complement(lo: int, end: int, covered: Iterable[Range]) -> list[Range]:
    """The offsets in [lo, end) that no range covers."""
    gaps: list[Range] = []
    cursor = lo
    for first, last in merge(covered):
        if first >= end:
            break
        if first > cursor:
            gaps.append((cursor, first - 1))
        cursor = max(cursor, last + 1)
    if cursor < end:
        gaps.append((cursor, end - 1))
    return gaps


def clip(ranges: Iterable[Range], lo: int, end: int) -> list[Range]:
    """The parts of the ranges inside [lo, end)."""
    return [(max(f, lo), min(last, end - 1)) for f, last in ranges if last >= lo and f < end]


def count(ranges: Iterable[Range]) -> int:
    return sum(last - first + 1 for first, last in ranges)


def within(offsets: np.ndarray, ranges: Sequence[Range]) -> np.ndarray:
    """Which of the offsets fall inside the sorted, disjoint ranges (a boolean mask)."""
    if not ranges or offsets.size == 0:
        return np.zeros(offsets.shape, dtype=bool)
    firsts = np.array([f for f, _ in ranges], dtype=np.int64)
    lasts = np.array([last for _, last in ranges], dtype=np.int64)
    at = np.searchsorted(firsts, offsets, side="right") - 1
    return (at >= 0) & (offsets <= lasts[np.maximum(at, 0)])


def describe_ranges(ranges: Sequence[Range], limit: int = _RANGE_LIMIT) -> str:
    """`3-7,12,20-25 (+4 more)`; `-` for none."""
    if not ranges:
        return "-"
    shown = ",".join(str(f) if f == last else f"{f}-{last}" for f, last in ranges[:limit])
    more = len(ranges) - limit
    return shown + (f" (+{more} more)" if more > 0 else "")


def repeated(sorted_offsets: np.ndarray) -> np.ndarray:
    """The distinct offsets that occur more than once in a sorted array."""
    if sorted_offsets.size < 2:
        return EMPTY
    return np.unique(sorted_offsets[1:][np.diff(sorted_offsets) == 0])
