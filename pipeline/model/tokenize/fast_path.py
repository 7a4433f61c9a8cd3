"""Whether the fast path serves a tokenizer: every setting of it that decides the ids
must be one the fast path reproduces (read from the Rust tokenizer's own
serialisation: BERT's WordPiece pipeline, [CLS] text [SEP], truncation on the right
at the model's limit, no padding, nothing it does not know), and on a built-in
sample of prose, control characters, mixed scripts and texts cut at that limit
(just under, at, just over and far past it) every id must equal the Rust
tokenizer's, text by text and joined as arrays; else the Rust tokenizer serves
every text."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from itertools import pairwise
from typing import Any

from pipeline.model.tokenize.batches import encode_taken_flat
from pipeline.model.tokenize.wordpiece import FastWordPiece

log = logging.getLogger(__name__)

# The settings the fast path reproduces, by section of the serialised tokenizer: any
# other key (a setting of a later `tokenizers`) leaves the text to the Rust tokenizer.
_SECTIONS = {
    "version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer",
    "post_processor", "decoder", "model",
}  # fmt: skip
_NORMALIZER_KEYS = {"type", "clean_text", "handle_chinese_chars", "strip_accents", "lowercase"}
_MODEL_KEYS = {
    "type", "unk_token", "continuing_subword_prefix", "max_input_chars_per_word", "vocab",
}  # fmt: skip
_TRUNCATION_KEYS = {"direction", "max_length", "strategy", "stride"}
# The Rust tokenizer's defaults where its serialisation leaves a key out.
_DEFAULT_PREFIX = "##"
_DEFAULT_MAX_WORD_CHARS = 100
# How often the parts of a text are doubled to pass the limit: 2**24 parts is past any model.
_MAX_DOUBLINGS = 24
# How many vocabulary entries are tried for a word of one token.
_MAX_TRIED = 500


def for_tokenizer(rust_tokenizer: Any, max_length: int) -> FastWordPiece | None:
    """The fast path for this `tokenizers.Tokenizer` (truncating at `max_length`), or
    None where a setting of it is not one the fast path reproduces or the check on
    the sample finds a difference."""
    spec = json.loads(rust_tokenizer.to_str())
    # Not in the serialised form: special tokens' text in a record read as plain text.
    split = "split_special_tokens" if rust_tokenizer.encode_special_tokens else None
    why = split or declined(spec, max_length)
    if why is not None:
        log.info("tokenizer: the Rust tokenizer serves every text (%s)", why)
        return None
    fast = _from_spec(spec, max_length)
    if not _agrees(fast, rust_tokenizer, _check_texts(rust_tokenizer, spec)):
        return None
    fast.forget_words()  # the sample's words are not the corpus's
    fast._unicode_source = (spec, rust_tokenizer, _mixed_check(rust_tokenizer))
    return fast


def declined(spec: dict[str, Any], max_length: int) -> str | None:
    """Why the fast path does not reproduce the serialised tokenizer `spec` truncating
    at `max_length`, or None where every setting that decides the ids is one it
    reproduces."""
    unknown = set(spec) - _SECTIONS
    if unknown:
        return f"unknown tokenizer settings {sorted(unknown)}"
    for check in (_normalizer_declined, _model_declined, _post_processor_declined):
        why = check(spec)
        if why is not None:
            return why
    if (spec.get("pre_tokenizer") or {}) != {"type": "BertPreTokenizer"}:
        return "its pre-tokenizer is not BERT's"
    if spec.get("padding") is not None:
        return "it pads"
    return _truncation_declined(spec.get("truncation"), max_length)


def _normalizer_declined(spec: dict[str, Any]) -> str | None:
    normalizer = spec.get("normalizer") or {}
    if normalizer.get("type") != "BertNormalizer" or set(normalizer) - _NORMALIZER_KEYS:
        return "its normaliser is not BERT's alone"
    if not normalizer.get("clean_text"):
        return "its normaliser keeps control characters (clean_text false)"
    return None


def _model_declined(spec: dict[str, Any]) -> str | None:
    model = spec.get("model") or {}
    if model.get("type") != "WordPiece" or set(model) - _MODEL_KEYS:
        return "its model is not WordPiece"
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or model.get("unk_token") not in vocab:
        return "its WordPiece vocabulary lacks the unknown token"
    # Added tokens are matched in the raw text before anything else: texts with one
    # go to the Rust tokenizer (FastWordPiece.match_specials), told apart by their "[".
    if any("[" not in added.get("content", "") for added in spec.get("added_tokens") or []):
        return "it has added tokens without '['"
    return None


def _post_processor_declined(spec: dict[str, Any]) -> str | None:
    vocab = (spec.get("model") or {}).get("vocab") or {}
    around = _cls_sep(spec.get("post_processor") or {})
    if around is None:
        return "its special tokens around a text are not [CLS] text [SEP]"
    if any(token not in vocab or vocab[token] != token_id for token, token_id in around):
        return "its [CLS] or [SEP] id is not the vocabulary's"
    return None


def _truncation_declined(truncation: dict[str, Any] | None, max_length: int) -> str | None:
    if truncation is None or set(truncation) - _TRUNCATION_KEYS:
        return "it does not truncate as the fast path does"
    if truncation.get("direction", "Right") != "Right":
        return f"it truncates on the {str(truncation['direction']).lower()} (truncation_side)"
    if truncation.get("strategy", "LongestFirst") != "LongestFirst":
        return f"it truncates by strategy {truncation['strategy']}"
    if truncation.get("stride", 0) != 0 or truncation.get("max_length") != max_length:
        return f"its truncation is not at {max_length} tokens without stride"
    if max_length < 2:
        return f"its maximum length {max_length} leaves no room for [CLS] and [SEP]"
    return None


def _agrees(
    fast: FastWordPiece, rust_tokenizer: Any, texts: Iterable[str], what: str = "sample"
) -> bool:
    """Whether the fast path's ids are the Rust tokenizer's on every text it takes:
    text by text, the ASCII ones all at once (`encode_ascii`), and every one at once
    as arrays (`encode_taken_flat`); and whether the texts it takes include one the
    Rust tokenizer cuts (else truncation went unchecked)."""
    sample = [text for text in texts if fast.handles(text)]
    expected = rust_tokenizer.encode_batch(sample, add_special_tokens=True)
    if not any(e.overflowing for e in expected):
        log.warning("tokenizer: the fast path took no %s text past the limit; not used", what)
        return False
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


def _from_spec(spec: dict[str, Any], max_length: int) -> FastWordPiece:
    """The fast path of a serialised tokenizer `declined` accepts."""
    normalizer, model = spec["normalizer"], spec["model"]
    around = _cls_sep(spec["post_processor"])
    assert around is not None, "declined() accepts only [CLS] text [SEP]"
    prefix = model.get("continuing_subword_prefix")
    max_word_chars = model.get("max_input_chars_per_word")
    fast = FastWordPiece(
        model["vocab"],
        lowercase=bool(normalizer.get("lowercase")),
        prefix=_DEFAULT_PREFIX if prefix is None else prefix,
        max_word_chars=_DEFAULT_MAX_WORD_CHARS if max_word_chars is None else int(max_word_chars),
        unk=model["unk_token"],
        cls=around[0][0],
        sep=around[1][0],
        max_length=max_length,
    )
    fast.match_specials(spec.get("added_tokens") or [])
    return fast


def _cls_sep(post: dict[str, Any]) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """The special tokens (token, id) around a single text: [CLS] text [SEP], or None
    for any other form."""
    if post.get("type") == "BertProcessing":
        (cls, cls_id), (sep, sep_id) = post["cls"], post["sep"]
        return (cls, cls_id), (sep, sep_id)
    if post.get("type") != "TemplateProcessing":
        return None
    single = post.get("single") or []
    if len(single) != 3 or (single[1].get("Sequence") or {}).get("id") != "A":
        return None
    first, last = single[0].get("SpecialToken"), single[2].get("SpecialToken")
    if not first or not last:
        return None
    ids = [(post.get("special_tokens") or {}).get(t["id"], {}).get("ids") for t in (first, last)]
    if any(not isinstance(one, list) or len(one) != 1 for one in ids):
        return None  # a special token of several ids, or none
    return (first["id"], ids[0][0]), (last["id"], ids[1][0])


def _check_texts(rust_tokenizer: Any, spec: dict[str, Any]) -> list[str]:
    """Prose, control characters, punctuation runs, long and unknown words, and
    truncation at the tokenizer's own limit: a text of single-token words just
    under, at and just over it, one cut inside a word's pieces, numbered prose far
    past it."""
    texts = [*_PROSE, "", "\t\n\r \x00\x07\x7f"]
    texts.append("Hello,World!!! (e.g.) 3.14159 -- x_y/z \\ ~`^{}<>@#$%&*+=|'\"?")
    texts.append("a" * 150 + " " + "unaffable " * 3 + "xqzxqzxqz zzzzzzzz")
    texts.append("CamelCaseWords MIXED case 123abc abc123 don't can't HTTPServer iPhone")
    texts.append("a[0] = b[i]; x[1:2] [mask] [Cls] [ SEP ] [[ ]]")
    texts.append("[CLS] special tokens [SEP] go to the Rust tokenizer [MASK]")
    ascii_words = (word for word in spec["model"]["vocab"] if word.isascii())
    one = _word_of_pieces(rust_tokenizer, ascii_words, 1)
    several = _word_of_pieces(rust_tokenizer, ["unaffable", "xqzxqzxqz", "embeddings"], 2)
    texts += _at_the_limit(rust_tokenizer, one, several)
    texts.append(_past_the_limit(rust_tokenizer, " ".join(_PROSE)))
    return texts


def _mixed_check(rust_tokenizer: Any) -> Callable[[FastWordPiece], bool]:
    """The check of the non-ASCII rules, once they are built: mixed-script texts, and
    those it takes cut at the tokenizer's limit (single-character words at it,
    joined texts past it)."""

    def agrees(fast: FastWordPiece) -> bool:
        taken = [text for text in _MIXED_TEXTS if fast.handles(text)]
        chars = [c for text in taken for c in text if not c.isascii() and fast.handles(c)]
        one = _word_of_pieces(rust_tokenizer, dict.fromkeys(chars), 1)
        texts = [*_MIXED_TEXTS, *_at_the_limit(rust_tokenizer, one, None)]
        if taken:
            texts += [_past_the_limit(rust_tokenizer, "".join(taken))]
            texts += [_past_the_limit(rust_tokenizer, " ".join(taken))]
        return _agrees(fast, rust_tokenizer, texts, "mixed-script")

    return agrees


def _word_of_pieces(rust_tokenizer: Any, candidates: Iterable[str], pieces: int) -> str | None:
    """The first candidate the tokenizer cuts into exactly one token (`pieces` 1) or at
    least `pieces`; None where none of the first few is."""
    tried = 0
    for word in candidates:
        if not word or "[" in word or word.isspace():
            continue
        tried += 1
        if tried > _MAX_TRIED:
            break
        count = len(rust_tokenizer.encode(word, add_special_tokens=False).ids)
        if count == pieces or (pieces > 1 and count >= pieces):
            return word
    return None


def _at_the_limit(rust_tokenizer: Any, one: str | None, several: str | None) -> list[str]:
    """Texts of the single-token word `one` with one token less than the limit takes,
    as many, and one more; then one whose last word (of `several` pieces) is cut."""
    if one is None:
        return []
    limit = rust_tokenizer.truncation["max_length"]
    body = limit - rust_tokenizer.num_special_tokens_to_add(False)
    texts = [" ".join([one] * max(n, 0)) for n in (body - 1, body, body + 1)]
    if several is not None and body >= 1:
        texts.append(" ".join([one] * (body - 1) + [several]))
    return texts


def _past_the_limit(rust_tokenizer: Any, unit: str) -> str:
    """Numbered parts of `unit` (so that its start and its end differ), doubled until
    the tokenizer cuts them."""
    text = unit
    for doubling in range(1, _MAX_DOUBLINGS):
        if rust_tokenizer.encode(text).overflowing:
            break
        text = " ".join(f"{part}. {unit}" for part in range(2**doubling))
    return text


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


# Chinese, mixed scripts, accents, full-width forms, emoji, odd spaces.
_MIXED_TEXTS = (
    "向量检索与语义缓存：动态批处理、量化和多副本服务。",
    "Kafka 消费者组在成员加入或离开时重新分配分区（rebalance）。",
    "Café au lait, naïve résumé — Ünïcödé ÀÉÎÕÜ façade Ångström.",
    "Привет, мир! Ελληνικά κείμενα. 日本語のテキスト、カタカナとひらがな。",
    "한국어 문장도 처리합니다. 全角ＡＢＣ１２３！？ “quotes” ‘single’ …",
    "emoji 😀🚀 and symbols © ® ™ € £ ¥ ½ ° ± × ÷ → ← ≤ ≥ ∞",
    "zero\u200bwidth\u00a0nbsp\u3000ideographic space\u2028line\ufeffbom",
)
