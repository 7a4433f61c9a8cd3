"""Whether the fast path serves a tokenizer: its declared pipeline must be exactly
BERT's WordPiece (read from its own tokenizer.json), and on a built-in sample of
prose, truncation, control characters and mixed scripts every id must equal the
Rust tokenizer's, text by text and joined as arrays; else the Rust tokenizer
serves every text."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from itertools import pairwise
from typing import Any

from pipeline.model.tokenize.batches import encode_taken_flat
from pipeline.model.tokenize.wordpiece import FastWordPiece

log = logging.getLogger(__name__)


def for_tokenizer(rust_tokenizer: Any, max_length: int) -> FastWordPiece | None:
    """The fast path for this `tokenizers.Tokenizer` (truncation at `max_length`),
    or None where its pipeline is not BERT's WordPiece or the check finds a difference."""
    try:
        spec = json.loads(rust_tokenizer.to_str())
    except Exception:  # not a tokenizers.Tokenizer we can read: the Rust path serves
        return None
    fast = _from_spec(spec, max_length)
    if fast is None:
        return None
    if not _agrees(fast, rust_tokenizer, _check_texts()):
        return None
    fast.forget_words()  # the sample's words are not the corpus's
    fast._unicode_source = (
        spec,
        rust_tokenizer,
        lambda f: _agrees(f, rust_tokenizer, _MIXED),
    )
    return fast


def _agrees(fast: FastWordPiece, rust_tokenizer: Any, texts: Iterable[str]) -> bool:
    """Whether the fast path's ids are the Rust tokenizer's on every text it takes:
    text by text, the ASCII ones all at once (`encode_ascii`), and every one at once
    as arrays (`encode_taken_flat`)."""
    sample = [text for text in texts if fast.handles(text)]
    expected = rust_tokenizer.encode_batch(sample, add_special_tokens=True)
    for text, encoding in zip(sample, expected, strict=True):
        if fast.encode(text) != (encoding.ids, bool(encoding.overflowing)):
            log.warning("tokenizer: the fast path differs on %r; not used", text[:60])
            return False
    in_ascii = [(t, e) for t, e in zip(sample, expected, strict=True) if t.isascii()]
    ids, truncated = fast.encode_ascii([t for t, _ in in_ascii])
    if ids != [e.ids for _, e in in_ascii] or truncated != sum(
        bool(e.overflowing) for _, e in in_ascii
    ):
        log.warning("tokenizer: the fast path differs on ASCII texts taken together; not used")
        return False
    flat, offsets, truncated, others = encode_taken_flat(fast, sample)
    if (
        others
        or [flat[a:b].tolist() for a, b in pairwise(offsets.tolist())] != [e.ids for e in expected]
        or truncated != sum(bool(e.overflowing) for e in expected)
    ):
        log.warning("tokenizer: the fast path differs on texts taken together as arrays; not used")
        return False
    return True


def _from_spec(spec: dict[str, Any], max_length: int) -> FastWordPiece | None:
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
    # Added tokens are matched in the raw text before anything else: texts with one
    # go to the Rust tokenizer (FastWordPiece.match_specials), told apart by their "[".
    added_tokens = spec.get("added_tokens") or []
    if any("[" not in added.get("content", "") for added in added_tokens):
        return None
    fast = FastWordPiece(
        vocab,
        lowercase=bool(normalizer.get("lowercase")),
        prefix=model.get("continuing_subword_prefix") or "##",
        max_word_chars=int(model.get("max_input_chars_per_word") or 100),
        unk=unk,
        cls=cls_sep[0],
        sep=cls_sep[1],
        max_length=max_length,
    )
    fast.match_specials(added_tokens)
    return fast


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
    yield "a[0] = b[i]; x[1:2] [mask] [Cls] [ SEP ] [[ ]]"
    yield "[CLS] special tokens [SEP] go to the Rust tokenizer [MASK]"


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


# Chinese, mixed scripts, accents, full-width forms, emoji, odd spaces; truncation.
_MIXED_TEXTS = (
    "向量检索与语义缓存：动态批处理、量化和多副本服务。",
    "Kafka 消费者组在成员加入或离开时重新分配分区（rebalance）。",
    "Café au lait, naïve résumé — Ünïcödé ÀÉÎÕÜ façade Ångström.",
    "Привет, мир! Ελληνικά κείμενα. 日本語のテキスト、カタカナとひらがな。",
    "한국어 문장도 처리합니다. 全角ＡＢＣ１２３！？ “quotes” ‘single’ …",
    "emoji 😀🚀 and symbols © ® ™ € £ ¥ ½ ° ± × ÷ → ← ≤ ≥ ∞",
    "zero\u200bwidth\u00a0nbsp\u3000ideographic space\u2028line\ufeffbom",
)
_MIXED = (*_MIXED_TEXTS, "".join(_MIXED_TEXTS * 30))
