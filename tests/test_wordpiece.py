"""The ASCII WordPiece fast path gives exactly the Rust tokenizer's ids, or is not used."""

from __future__ import annotations

import json
import random
import string

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from pipeline import wordpiece
from pipeline.corpus import sample_texts
from pipeline.embedder import TOKENIZER_ENV, Embedder


def rust(embedder: Embedder) -> Tokenizer:
    return embedder._fast


def ascii_fuzz(count: int, seed: int = 7) -> list[str]:
    """Random ASCII: words, digits, every punctuation character, control characters,
    runs of whitespace, very long words; no "[" (those go to the Rust tokenizer)."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + string.punctuation.replace("[", "")
    alphabet += " \t\n\r\x00\x01\x07\x0b\x0c\x1f\x7f"
    texts = []
    for _ in range(count):
        words = [
            "".join(rng.choice(alphabet) for _ in range(rng.choice((1, 3, 8, 20, 120))))
            for _ in range(rng.randint(0, 40))
        ]
        texts.append(rng.choice((" ", "  ", "\n")).join(words))
    return texts


def test_ids_and_truncation_equal_the_rust_tokenizers(embedder: Embedder) -> None:
    fast = wordpiece.for_tokenizer(rust(embedder), embedder.info.max_length)
    assert fast is not None
    prose = sample_texts(3000)
    long = [" ".join(prose[i : i + 12]) for i in range(0, 600, 12)]  # past max_length
    texts = [t for t in prose + long + ascii_fuzz(3000) if fast.handles(t)]
    assert len(texts) > 5000
    expected = rust(embedder).encode_batch(texts, add_special_tokens=True)
    mismatched = [
        text
        for text, want in zip(texts, expected, strict=True)
        if fast.encode(text) != (want.ids, bool(want.overflowing))
    ]
    assert mismatched == []
    assert sum(bool(e.overflowing) for e in expected) >= len(long)  # truncation was met


def test_texts_it_does_not_handle_go_to_the_rust_tokenizer_in_order(embedder: Embedder) -> None:
    texts = [
        "plain ascii text",
        "Café au lait, naïve résumé",  # accents: stripped by the Rust normaliser
        "向量检索与语义缓存",  # CJK: one token per character there
        "a [MASK] in the text",  # special tokens are matched in raw text
        "mixed 中文 and English",
        "   ",
        "last one, plain again",
    ]
    got = embedder.tokenize(texts)
    want, truncated = embedder._encode(texts)
    assert got.ids == want
    assert got.truncated == truncated
    assert [wordpiece.AsciiWordPiece.handles(t) for t in texts] == [1, 0, 0, 0, 0, 1, 1]


def test_the_rust_tokenizer_can_be_chosen(monkeypatch: pytest.MonkeyPatch, embedder) -> None:
    monkeypatch.setenv(TOKENIZER_ENV, "rust")
    from pipeline.embedder import _tokenizer_choice

    assert _tokenizer_choice() == "rust"
    monkeypatch.setenv(TOKENIZER_ENV, "fastest")
    with pytest.raises(Exception, match="PIPELINE_TOKENIZER"):
        _tokenizer_choice()


def test_remembered_words_stay_bounded(monkeypatch: pytest.MonkeyPatch, embedder: Embedder) -> None:
    monkeypatch.setattr(wordpiece, "MAX_REMEMBERED_WORDS", 50)
    fast = wordpiece.for_tokenizer(rust(embedder), embedder.info.max_length)
    assert fast is not None
    texts = ascii_fuzz(300, seed=11)
    expected = rust(embedder).encode_batch(texts, add_special_tokens=True)
    for text, want in zip(texts, expected, strict=True):
        assert fast.encode(text)[0] == want.ids
        assert len(fast._memo) <= 50


def _with(tokenizer: Tokenizer, **changes: object) -> Tokenizer:
    spec = json.loads(tokenizer.to_str())
    for path, value in changes.items():
        section, key = path.split("__")
        spec[section][key] = value
    return Tokenizer.from_str(json.dumps(spec))


def test_other_tokenizer_pipelines_are_refused(embedder: Embedder) -> None:
    base = rust(embedder)
    length = embedder.info.max_length
    assert wordpiece.for_tokenizer(base, length) is not None
    # Control characters kept, another pre-tokenizer, another model: not BERT's pipeline.
    assert wordpiece.for_tokenizer(_with(base, normalizer__clean_text=False), length) is None
    with_word = Tokenizer.from_str(base.to_str())
    with_word.add_tokens(["pipeline"])  # matched whole, even inside "pipelines"
    assert wordpiece.for_tokenizer(with_word, length) is None
    other = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    other.normalizer = normalizers.Lowercase()
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    assert wordpiece.for_tokenizer(other, length) is None


def test_a_fast_path_the_check_disagrees_with_is_refused(
    monkeypatch: pytest.MonkeyPatch, embedder: Embedder
) -> None:
    """If the declared pipeline reads as BERT's but the ids differ anyway, the check
    at load refuses it: here a continuation prefix misread from the spec."""
    read = wordpiece._from_spec

    def misread(spec: dict, max_length: int) -> wordpiece.AsciiWordPiece | None:
        fast = read(spec, max_length)
        if fast is not None:
            fast._prefix = "@@"
        return fast

    monkeypatch.setattr(wordpiece, "_from_spec", misread)
    assert wordpiece.for_tokenizer(rust(embedder), embedder.info.max_length) is None
