"""BERT's WordPiece for ASCII text in a few microseconds: the same ids as the Rust tokenizer.

The Rust tokenizer tracks every character's offsets through normalisation and
builds a full Encoding per text: on the CPU it cost 90-100 µs for a short
paragraph, three to five times what Kafka and JSON cost for the same record,
and the worker's largest cost after the model. For plain ASCII the BERT
pipeline is simple: drop control characters, lower-case (uncased models), split
into runs of letters and digits and single punctuation characters, and cut each
word greedily into the longest vocabulary pieces ("##" inside words). Words
repeat (Zipf), so each word's pieces are remembered: a paragraph then costs a
regex, a lower() and a dictionary lookup per word (about 14 µs).

Only tokenizers whose declared pipeline is exactly that one qualify (read from
their own tokenizer.json), and only texts that are ASCII without "[" (special
tokens such as "[MASK]" are matched in the raw text); everything else goes to
the Rust tokenizer. At load the two are compared on a built-in sample and the
fast path is refused unless every id agrees.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from itertools import chain
from typing import Any

log = logging.getLogger(__name__)

# What BertNormalizer's clean_text removes from ASCII (tab, newline and carriage
# return are whitespace and stay, as separators).
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# BERT's punctuation in ASCII: every printable character that is not a letter or digit.
_PUNCTUATION = r"[!-/:-@\[-`{-~]"
_UNCASED_WORDS = re.compile(rf"[a-z0-9]+|{_PUNCTUATION}")
_CASED_WORDS = re.compile(rf"[A-Za-z0-9]+|{_PUNCTUATION}")
# The memo of word -> pieces: the common words of a corpus, a few MB at most.
MAX_REMEMBERED_WORDS = 50_000


class AsciiWordPiece:
    """Token ids (with [CLS] and [SEP], truncated to `max_length`) of ASCII texts."""

    def __init__(
        self,
        vocab: dict[str, int],
        *,
        lowercase: bool,
        prefix: str,
        max_word_chars: int,
        unk: str,
        cls: str,
        sep: str,
        max_length: int,
    ) -> None:
        self._vocab = vocab
        self._lowercase = lowercase
        self._words = _UNCASED_WORDS if lowercase else _CASED_WORDS
        self._prefix = prefix
        self._max_word_chars = max_word_chars
        self._unk = vocab[unk]
        self._cls = vocab[cls]
        self._sep = vocab[sep]
        self._max_body = max_length - 2
        self._memo: dict[str, list[int]] = {}

    @staticmethod
    def handles(text: str) -> bool:
        return text.isascii() and "[" not in text

    def encode(self, text: str) -> tuple[list[int], bool]:
        """(ids, whether the text was truncated) of a text that `handles` accepts."""
        if _CONTROL.search(text):
            text = _CONTROL.sub("", text)
        if self._lowercase:
            text = text.lower()
        words = self._words.findall(text)
        found = list(map(self._memo.get, words))
        if None in found:
            found = [self._memo.get(word) or self._pieces(word) for word in words]
        ids = [self._cls, *chain.from_iterable(found)]
        truncated = len(ids) - 1 > self._max_body
        if truncated:
            del ids[self._max_body + 1 :]
        ids.append(self._sep)
        return ids, truncated

    def _pieces(self, word: str) -> list[int]:
        too_long = len(word) > self._max_word_chars
        pieces = [self._unk] if too_long else self._longest_first(word)
        if len(self._memo) >= MAX_REMEMBERED_WORDS:
            self._memo.clear()  # rare; the common words come back at once
        self._memo[word] = pieces
        return pieces

    def _longest_first(self, word: str) -> list[int]:
        """WordPiece's greedy longest-match-first; the whole word is [UNK] when a
        part of it matches nothing."""
        pieces: list[int] = []
        start = 0
        while start < len(word):
            for end in range(len(word), start, -1):
                part = word[start:end] if start == 0 else self._prefix + word[start:end]
                piece = self._vocab.get(part)
                if piece is not None:
                    pieces.append(piece)
                    start = end
                    break
            else:
                return [self._unk]
        return pieces


def for_tokenizer(rust_tokenizer: Any, max_length: int) -> AsciiWordPiece | None:
    """The fast path for this `tokenizers.Tokenizer` (truncation at `max_length`),
    or None where its pipeline is not BERT's WordPiece or the check finds a difference."""
    try:
        spec = json.loads(rust_tokenizer.to_str())
    except Exception:  # not a tokenizers.Tokenizer we can read: the Rust path serves
        return None
    fast = _from_spec(spec, max_length)
    if fast is None:
        return None
    sample = [text for text in _check_texts() if fast.handles(text)]
    expected = rust_tokenizer.encode_batch(sample, add_special_tokens=True)
    for text, encoding in zip(sample, expected, strict=True):
        if fast.encode(text) != (encoding.ids, bool(encoding.overflowing)):
            log.warning("tokenizer: the ASCII fast path differs on %r; not used", text[:60])
            return None
    fast._memo.clear()  # the sample's words are not the corpus's
    return fast


def _from_spec(spec: dict[str, Any], max_length: int) -> AsciiWordPiece | None:
    normalizer = spec.get("normalizer") or {}
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer") or {}
    if normalizer.get("type") != "BertNormalizer" or not normalizer.get("clean_text"):
        return None
    if pre.get("type") != "BertPreTokenizer" or model.get("type") != "WordPiece":
        return None
    cls_sep = _cls_sep(spec.get("post_processor") or {})
    vocab = model.get("vocab")
    unk = model.get("unk_token")
    if cls_sep is None or not isinstance(vocab, dict) or unk not in vocab:
        return None
    if any(token not in vocab for token in cls_sep) or max_length < 2:
        return None
    # Added tokens are matched in the raw text before anything else: texts with "["
    # go to the Rust tokenizer, so only tokens that contain one can be left to it.
    if any("[" not in added.get("content", "") for added in spec.get("added_tokens") or []):
        return None
    return AsciiWordPiece(
        vocab,
        lowercase=bool(normalizer.get("lowercase")),
        prefix=model.get("continuing_subword_prefix") or "##",
        max_word_chars=int(model.get("max_input_chars_per_word") or 100),
        unk=unk,
        cls=cls_sep[0],
        sep=cls_sep[1],
        max_length=max_length,
    )


def _cls_sep(post: dict[str, Any]) -> tuple[str, str] | None:
    """The special tokens around a single text: [CLS] text [SEP], or None for any other form."""
    if post.get("type") == "BertProcessing":
        return post["cls"][0], post["sep"][0]
    if post.get("type") != "TemplateProcessing":
        return None
    single = post.get("single") or []
    if len(single) != 3 or "Sequence" not in single[1]:
        return None
    first, last = single[0].get("SpecialToken"), single[2].get("SpecialToken")
    if not first or not last:
        return None
    return first["id"], last["id"]


def _check_texts() -> Iterable[str]:
    """Prose, truncation, control characters, punctuation runs, long and unknown words."""
    yield from _PROSE
    yield " ".join(_PROSE * 8)  # longer than any max_length
    yield ""
    yield "\t\n\r \x00\x07\x7f"
    yield "Hello,World!!! (e.g.) 3.14159 -- x_y/z \\ ~`^{}<>@#$%&*+=|'\"?"
    yield "a" * 150 + " " + "unaffable " * 3 + "xqzxqzxqz zzzzzzzz"
    yield "CamelCaseWords MIXED case 123abc abc123 don't can't HTTPServer iPhone"


_PROSE = (
    "The quick brown fox jumps over the lazy dog.",
    "Kafka consumer groups rebalance partitions when a member joins or leaves.",
    "Embeddings are written to Parquet files and indexed with FAISS for search.",
    "Dynamic batching closes a micro-batch by record count, timeout or token budget.",
    "Return a new list containing all items from the iterable in ascending order.",
    "If the optional argument is given, it must be a non-negative integer (default: 0).",
    "Unicode normalization and tokenization: WordPiece splits rare words into pieces.",
    "SELECT id, text FROM corpus WHERE length(text) > 300 ORDER BY id LIMIT 10;",
    "https://example.com/path?query=1&b=2#frag user@example.org 192.168.0.1:9092",
    "Version 3.0.12 -- released 2026-11-30; see CHANGES.rst for the full list.",
)
