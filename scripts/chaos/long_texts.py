"""Chunk mode's texts (`scripts/chaos --chunk-tokens N [--chunk-overlap M]`): long
records that the workers cut into many chunks, mixed with the usual short ones.

Built on this machine, nothing downloaded (scripts/harness/corpora.py): English
paragraphs of the standard library's docstrings, and Chinese from the gettext
catalogues (or Python's CJK test files). A long text is paragraphs drawn with the
seed's generator and joined until it reaches a size drawn between 3 and 20 KB
(several times the default model's 256 tokens), or a budget of model tokens that
keeps its chunks well inside the worker's default `--max-chunks` (half of it, at
N - M tokens a chunk), so that no record the harness calls good goes to the
dead-letter topic as TooManyChunks. Medium texts, of half a window to a few
windows, put records right around the first cuts.

Token counts come from the model's own tokenizer (its tokenizer.json, the Rust
tokenizer, truncation off); where a model has none, from an estimate (a CJK
character a token, else four characters a token). The check uses the same counts
to hold the chunker to its word: no chunk over N tokens, a record over N tokens
cut, one within N not.
"""

from __future__ import annotations

import functools
import json
import random
import threading
import unicodedata
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos.common import MAX_CHUNKS, MAX_TEXT_BYTES

LONG_BYTES = (3_000, 20_000)
# The share of good records of each kind in chunk mode (the rest: the usual short ones).
KINDS = (
    ("long-english", 0.10),
    ("long-chinese", 0.04),
    ("long-mixed", 0.03),
    ("medium", 0.08),
    ("short-chinese", 0.05),
)
LONG_KINDS = {"long-english", "long-chinese", "long-mixed"}


@functools.lru_cache(maxsize=1)
def _pools() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """English paragraphs and Chinese texts of this machine, distinct, in a fixed order."""
    from harness.corpora import chinese, english

    en = tuple(dict.fromkeys(t.strip() for t in english(4000) if t.strip()))
    zh = tuple(dict.fromkeys(t.strip() for t in chinese(3000) if t.strip()))
    return en, zh


@functools.lru_cache(maxsize=4)
def _tokenizer(model: Path) -> Any:
    path = model / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


@functools.lru_cache(maxsize=4)
def _pool_tokens(model: Path) -> tuple[list[int], list[int]]:
    """Model tokens of each text of the pools (once per model: the seeds share them)."""
    en, zh = _pools()
    tokenizer = _tokenizer(model)
    counts = []
    for pool in (en, zh):
        if tokenizer is None:
            counts.append([_estimate(t) for t in pool])
        else:
            done = tokenizer.encode_batch(list(pool), add_special_tokens=False) if pool else []
            counts.append([len(e.ids) for e in done])
    return counts[0], counts[1]


def model_length(model: Path) -> int | None:
    """The model's max_seq_length (sentence_bert_config.json), None if it says none."""
    try:
        config = json.loads((model / "sentence_bert_config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_seq_length")
    return int(value) if isinstance(value, int) else None


def _estimate(text: str) -> int:
    cjk = sum(1 for c in text if unicodedata.east_asian_width(c) in "WF")
    return cjk + (len(text) - cjk + 3) // 4


@dataclass
class Drawn:
    """What LongTexts.text made of one record: its kind, for the report."""

    kind: str
    text: str


class LongTexts:
    """The texts of a chunk-mode seed's good records, drawn with the caller's generator."""

    def __init__(self, model: Path, chunk_tokens: int, chunk_overlap: int = 0) -> None:
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.chunk_overlap = chunk_overlap
        self.en, self.zh = _pools()
        if not self.en:
            raise ValueError("no English paragraphs on this machine (pipeline.core.corpus)")
        self._tokenizer = _tokenizer(model)
        step = max(1, chunk_tokens - chunk_overlap)
        self.budget = step * MAX_CHUNKS // 2  # tokens of a long text, at most
        self._en_tokens, self._zh_tokens = _pool_tokens(model)
        self.counts: Counter[str] = Counter()  # texts drawn of each kind (for the report)
        self._lock = threading.Lock()  # the trickle's thread and the plan's publish

    @property
    def has_tokenizer(self) -> bool:
        """Whether token counts are the model's (else estimates)."""
        return self._tokenizer is not None

    def tokens(self, texts: list[str]) -> list[int]:
        """Model tokens of each text alone (no special tokens, no prompt)."""
        if self._tokenizer is None:
            return [_estimate(t) for t in texts]
        done = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [len(e.ids) for e in done]

    def text(self, rng: random.Random, tag: str) -> Drawn | None:
        """A chunk-mode text ending with `(tag)`, or None for the usual short one."""
        draw, kind = rng.random(), None
        for name, share in KINDS:
            if draw < share:
                kind = name
                break
            draw -= share
        if kind is None or (not self.zh and "chinese" in kind):
            return None
        if kind == "short-chinese":
            body = rng.choice(self.zh)
        elif kind == "medium":
            pools = ["en", "zh"] if self.zh else ["en"]
            target = rng.randint(self.chunk_tokens // 2, 4 * self.chunk_tokens)
            body = self._join(rng, rng.choice(pools), 10**9, target)
        else:
            size = rng.randint(*LONG_BYTES)
            pools = {"long-english": "en", "long-chinese": "zh"}.get(kind, "mixed")
            body = self._join(rng, pools, size, self.budget)
        with self._lock:
            self.counts[kind] += 1
        return Drawn(kind, f"{body} ({tag})")

    def _join(self, rng: random.Random, pools: str, size: int, tokens: int) -> str:
        """Paragraphs joined until `size` UTF-8 bytes or `tokens` model tokens (never
        past the budget, nor near --max-text-bytes); always at least one."""
        parts: list[str] = []
        have_bytes = have_tokens = 0
        limit = min(tokens, self.budget)
        for attempt in range(10_000):
            use_zh = pools == "zh" or (pools == "mixed" and attempt % 2 == 1)
            pool, counts = (self.zh, self._zh_tokens) if use_zh else (self.en, self._en_tokens)
            n = rng.randrange(len(pool))
            text, count = pool[n], counts[n]
            if parts and have_tokens + count > limit:
                if have_tokens >= limit // 2:
                    break
                continue  # a smaller paragraph may still fit
            parts.append(text)
            have_bytes += len(text.encode()) + 2
            have_tokens += count
            if have_bytes >= min(size, MAX_TEXT_BYTES // 2) or have_tokens >= limit:
                break
        # Chinese runs on without spaces; English paragraphs as paragraphs.
        joiner = "" if pools == "zh" and rng.random() < 0.5 else "\n\n"
        return joiner.join(parts)
