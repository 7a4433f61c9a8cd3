"""Many texts' ids as one array: each text's ids end to end and where each starts,
merged from groups of texts tokenized apart, in numpy rather than a list a text."""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

import numpy as np

from pipeline.model.tokenize.text import PLAIN_ASCII, TEXT_END


def partition(texts: list[str], goes_alone: Callable[[str], bool]) -> tuple[list[int], list[int]]:
    """The indices of the texts that may be tokenized joined with others, and of
    those that go alone."""
    together: list[int] = []
    alone: list[int] = []
    for i, text in enumerate(texts):
        (alone if goes_alone(text) else together).append(i)
    return together, alone


def has_controls(text: str) -> bool:
    """An ASCII text with characters BERT drops (it cannot be split joined with others)."""
    return bool(text.encode("ascii").translate(None, PLAIN_ASCII))


def has_end_mark(text: str) -> bool:
    return TEXT_END in text


def encoded_alone(
    fast: Any, texts: list[str], indices: list[int]
) -> tuple[tuple[list[int], np.ndarray, np.ndarray], int]:
    """The texts at `indices`, each encoded alone, as a group for `_merged`; and how
    many of them were truncated."""
    encoded = [fast.encode(texts[i]) for i in indices]
    group = (indices, *end_to_end([ids for ids, _ in encoded]))
    return group, sum(cut for _, cut in encoded)


def end_to_end(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    offsets = np.zeros(len(ids) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return np.fromiter(chain.from_iterable(ids), np.int32, int(offsets[-1])), offsets


def merged(
    count: int, groups: list[tuple[list[int], np.ndarray, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray]:
    """One array of ids end to end, in text order, from groups of (the texts'
    indices, their ids end to end, their offsets); texts in no group get none."""
    if len(groups) == 1 and len(groups[0][0]) == count:
        return groups[0][1], groups[0][2]  # every text, in order
    lengths = np.zeros(count, np.int64)
    for indices, _, offsets in groups:
        lengths[indices] = np.diff(offsets)
    merged = np.zeros(count + 1, np.int64)
    np.cumsum(lengths, out=merged[1:])
    ids = np.empty(int(merged[-1]), np.int32)
    for indices, group_ids, offsets in groups:
        # Each text's ids move by (where they go) - (where they were): one shift a text.
        shift = np.repeat(merged[indices] - offsets[:-1], np.diff(offsets))
        ids[shift + np.arange(len(group_ids))] = group_ids
    return ids, merged
