"""The fast path over a batch of texts: the ids of those it takes, joined by kind
(ASCII, then other text it was shown to treat alike), and the Rust tokenizer's for
the others; as lists (in-process) or as one array (the tokenizer process)."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np

from pipeline.model.tokenize import arrays
from pipeline.model.tokenize.wordpiece import FastWordPiece


def encode_taken(fast: FastWordPiece, texts: list[str]) -> tuple[list[list[int]], int, list[int]]:
    """(ids, truncated, others): the ids of every text `fast` takes, the ASCII ones
    joined and the non-ASCII ones joined; `others` are the indices of the texts
    it leaves to the Rust tokenizer (their ids here are empty)."""
    plain, single, others = _taken_kinds(fast, texts)
    ids: list[list[int]] = [[]] * len(texts)
    truncated = 0
    if single:
        # Joined and split in numpy (a third of the CPU of `encode` a text), then lists.
        flat, offsets, truncated = fast.encode_unicode_flat([texts[i] for i in single])
        for i, (start, end) in zip(single, pairwise(offsets.tolist()), strict=True):
            ids[i] = flat[start:end].tolist()
    if plain:
        plain_ids, plain_truncated = fast.encode_ascii([texts[i] for i in plain])
        for i, one in zip(plain, plain_ids, strict=True):
            ids[i] = one
        truncated += plain_truncated
    return ids, truncated, others


def encode_taken_flat(
    fast: FastWordPiece, texts: list[str], rust_tokenizer: Any = None
) -> tuple[np.ndarray, np.ndarray, int, list[int]]:
    """`encode_taken` as arrays: every text's ids end to end (int32), the offsets
    where each starts (and the last ends), truncated and others (their ids empty).
    The texts' ids are placed in numpy (`FastWordPiece.encode_ascii_flat`,
    `encode_unicode_flat`), without a list of ids a text. With the Rust tokenizer
    `fast` was built from, the others are tokenized with it here (none are left)."""
    plain, single, others = _taken_kinds(fast, texts)
    groups: list[tuple[list[int], np.ndarray, np.ndarray]] = []
    truncated = 0
    for indices, encode in ((plain, fast.encode_ascii_flat), (single, fast.encode_unicode_flat)):
        if indices:
            group_ids, group_offsets, cut = encode([texts[i] for i in indices])
            groups.append((indices, group_ids, group_offsets))
            truncated += cut
    if others and rust_tokenizer is not None:
        other_ids, other_offsets, cut, _ = encode_rust_flat(
            rust_tokenizer, [texts[i] for i in others]
        )
        groups.append((others, other_ids, other_offsets))
        truncated += cut
        others = []
    ids, offsets = arrays.merged(len(texts), groups)
    return ids, offsets, truncated, others


def encode_rust_flat(
    rust_tokenizer: Any, texts: list[str]
) -> tuple[np.ndarray, np.ndarray, int, list[int]]:
    """`encode_taken_flat`'s arrays, every text through the Rust tokenizer."""
    encodings = rust_tokenizer.encode_batch(texts, add_special_tokens=True)
    ids, offsets = arrays.end_to_end([e.ids for e in encodings])
    return ids, offsets, sum(bool(e.overflowing) for e in encodings), []


def _taken_kinds(fast: FastWordPiece, texts: list[str]) -> tuple[list[int], list[int], list[int]]:
    """The indices of the ASCII texts `fast` takes, of the non-ASCII ones it takes
    and of those it leaves to the Rust tokenizer."""
    plain: list[int] = []
    single: list[int] = []
    others: list[int] = []
    for i, (text, taken) in enumerate(zip(texts, fast.handles_many(texts), strict=True)):
        if not taken:
            others.append(i)
        elif text.isascii():
            plain.append(i)
        else:
            single.append(i)
    return plain, single, others
