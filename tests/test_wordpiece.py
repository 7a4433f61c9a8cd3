"""The WordPiece fast path gives exactly the Rust tokenizer's ids, or is not used."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import string
import subprocess
import sys
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from pipeline.core.corpus import sample_texts
from pipeline.model.embedder import TOKENIZER_ENV, Embedder
from pipeline.model.tokenize import batches, fast_path, unicode_rules, wordpiece


def rust(embedder: Embedder) -> Tokenizer:
    return embedder._fast


# Special tokens, some as the tokenizer matches them (case and all), some not.
_SPECIALS = ("[CLS]", "[SEP]", "[MASK]", "[UNK]", "[PAD]", "[mask]", "[Cls]", "[ CLS]", "[[SEP]")


def ascii_fuzz(count: int, seed: int = 7, controls: bool = True) -> list[str]:
    """Random ASCII: words, digits, every punctuation character, control characters
    (unless told not to), runs of whitespace, very long words, special tokens."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + string.punctuation + " \t\n\r"
    if controls:
        alphabet += "\x00\x01\x07\x0b\x0c\x1c\x1f\x7f"
    texts = []
    for _ in range(count):
        words = [
            rng.choice(_SPECIALS)
            if rng.random() < 0.01
            else "".join(rng.choice(alphabet) for _ in range(rng.choice((1, 3, 8, 20, 120))))
            for _ in range(rng.randint(0, 40))
        ]
        texts.append(rng.choice((" ", "  ", "\n", "")).join(words))
    return texts


# Characters of every kind the non-ASCII rules meet: CJK ideographs (one word each),
# CJK and full-width punctuation, accented Latin (stripped where uncased), a final
# sigma (lower-cased by context in Python only), Cyrillic, kana with voiced marks
# (NFD splits them), Hangul (NFD makes jamo), combining marks, zero-width and
# format characters (dropped), non-ASCII spaces, emoji, a CJK compatibility
# ideograph (NFD maps it), a supplementary ideograph and unassigned code points
# (not taken: those texts go to the Rust tokenizer).
_UNICODE_ALPHABET = (
    "向量检索与语义缓存动态批处理量化多副本服务的一是了不在有人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年"
    "，。、；：？！「」『』（）《》【】——……·～"
    "ＡＢＣａｂｃ１２３！＃％＆"
    "àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿÀÉÎÕÜßŒœŠšŽžĀāĒēıİ"
    "ΑΒΓΔΕΣσςαβγδεωΩ"
    "привет мир ЁЖЗИЙ"
    "がぎぐげござじずぜぞカタカナひらがなパピプ"
    "한국어문장처리각"
    "̧́̈​‍﻿­  　 "
    "😀🚀👍🏽❤️©®™€£¥½°±×÷→←≤≥∞"
    "豈𠀌󠀁͸￿"
)


def unicode_fuzz(count: int, seed: int = 13) -> list[str]:
    """Random mixed-language texts: runs of ASCII and of the characters above."""
    rng = random.Random(seed)
    ascii_part = string.ascii_letters + string.digits + " ,.-'\"()\t\n\x00\x07\x7f"
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 12)):
            alphabet = _UNICODE_ALPHABET if rng.random() < 0.6 else ascii_part
            parts.append("".join(rng.choice(alphabet) for _ in range(rng.choice((1, 2, 5, 12)))))
        texts.append(rng.choice(("", " ")).join(parts))
    return texts


def equal_to_rust(fast: wordpiece.FastWordPiece, tokenizer: Tokenizer, texts: list[str]) -> int:
    """Asserts the fast path's ids on the texts it handles are the Rust tokenizer's;
    returns how many it handled."""
    handled = [t for t in texts if fast.handles(t)]
    expected = tokenizer.encode_batch(handled, add_special_tokens=True)
    mismatched = [
        text
        for text, want in zip(handled, expected, strict=True)
        if fast.encode(text) != (want.ids, bool(want.overflowing))
    ]
    assert mismatched == []
    equal_to_rust_in_batches(fast, tokenizer, [t for t in handled if t.isascii()])
    for size in (1, 97, 2000):
        flat_equal_to_rust(fast, [e.ids for e in expected], handled, size)
    return len(handled)


def flat_equal_to_rust(
    fast: wordpiece.FastWordPiece, expected: list[list[int]], texts: list[str], size: int
) -> None:
    """The batch path as the tokenizer process runs it (`encode_taken_flat`: ASCII and
    non-ASCII texts, each kind joined) gives `expected`, batch by batch."""
    for start in range(0, len(texts), size):
        batch = texts[start : start + size]
        flat, offsets, _, others = batches.encode_taken_flat(fast, batch)
        got = [flat[a:b].tolist() for a, b in pairwise(offsets)]
        assert (got, others) == (expected[start : start + size], [])


def equal_to_rust_in_batches(
    fast: wordpiece.FastWordPiece, tokenizer: Tokenizer, texts: list[str], size: int = 97
) -> None:
    """The ASCII batch path (`encode_ascii`) gives the Rust tokenizer's ids and
    truncation count, batch by batch (texts with control characters among them)."""
    for start in range(0, len(texts), size):
        batch = texts[start : start + size]
        expected = tokenizer.encode_batch(batch, add_special_tokens=True)
        ids, truncated = fast.encode_ascii(batch)
        assert ids == [e.ids for e in expected]
        assert truncated == sum(bool(e.overflowing) for e in expected)
        # The same as arrays, as the tokenizer process sends them.
        flat, offsets, flat_truncated, others = batches.encode_taken_flat(fast, batch)
        assert [flat[a:b].tolist() for a, b in pairwise(offsets)] == ids
        assert (flat_truncated, others, flat.dtype) == (truncated, [], np.int32)


def test_ids_and_truncation_equal_the_rust_tokenizers(embedder: Embedder) -> None:
    fast = fast_path.for_tokenizer(rust(embedder), embedder.info.max_length)
    assert fast is not None
    prose = sample_texts(3000)
    long = [" ".join(prose[i : i + 12]) for i in range(0, 600, 12)]  # past max_length
    fuzz = ascii_fuzz(3000) + ascii_fuzz(3000, seed=8, controls=False)
    texts = [t for t in prose + long + fuzz if fast.handles(t)]
    assert len(texts) > 7000
    assert sum("[" in t for t in texts) > 1000  # brackets without a special token stay
    expected = rust(embedder).encode_batch(texts, add_special_tokens=True)
    mismatched = [
        text
        for text, want in zip(texts, expected, strict=True)
        if fast.encode(text) != (want.ids, bool(want.overflowing))
    ]
    assert mismatched == []
    assert sum(bool(e.overflowing) for e in expected) >= len(long)  # truncation was met
    texts = [t for t in texts if t.isascii()]
    equal_to_rust_in_batches(fast, rust(embedder), texts)
    rng = random.Random(3)
    mixed_sizes = texts[:]
    rng.shuffle(mixed_sizes)
    equal_to_rust_in_batches(fast, rust(embedder), mixed_sizes, size=1)
    equal_to_rust_in_batches(fast, rust(embedder), mixed_sizes, size=4096)


def test_special_tokens_go_to_the_rust_tokenizer_other_brackets_do_not(
    embedder: Embedder,
) -> None:
    fast = fast_path.for_tokenizer(rust(embedder), embedder.info.max_length)
    assert fast is not None
    # all-MiniLM's special tokens are matched in the raw text, case and all.
    for text in ("a [MASK] b", "x[CLS]", "[SEP]", "[[UNK]]", "pad [PAD]"):
        assert not fast.handles(text), text
    for text in ("a[0] = b[i]", "[mask] [Cls]", "[ CLS ]", "[", "list[str] | None"):
        assert fast.handles(text), text
    texts = ["a [MASK] b", "a[0] = b[i]", "[mask] x", "x[CLS]y", "[", "]"]
    assert embedder.tokenize(texts).ids == embedder._encode(texts)[0]
    # Tokens matched after normalisation ("[mask]" would be one): every "[" goes to Rust.
    spec = json.loads(rust(embedder).to_str())
    for token in spec["added_tokens"]:
        token["normalized"] = True
    normalized = Tokenizer.from_str(json.dumps(spec))
    fast = fast_path.for_tokenizer(normalized, embedder.info.max_length)
    assert fast is not None
    assert not fast.handles("a[0] = b[i]") and not fast.handles("[mask]")
    assert fast.handles("plain text")


def test_mixed_language_texts_equal_the_rust_tokenizers(embedder: Embedder) -> None:
    fast = fast_path.for_tokenizer(rust(embedder), embedder.info.max_length)
    assert fast is not None and fast.unicode_rules() is not None
    texts = unicode_fuzz(4000)
    texts += ["".join(texts[i : i + 40]) for i in range(0, 2000, 40)]  # past max_length
    # Edges of the joined batch path: a NUL of a text's own (the end mark between
    # texts), texts of nothing but dropped characters or spaces, marks alone.
    texts += ["向量\x00检索", "é\x00", "　", "\u200b", "\u0301", "é", "a\x07向b\x7f", " 向 "]
    texts += ["\t向\n", "向" * 600, "Ā\u0301x", "\u3000\u00a0", "ﬁ", "Σ", "ΑΣ ΣΑ"]
    handled = equal_to_rust(fast, rust(embedder), texts)
    assert handled > len(texts) // 3
    assert any(not t.isascii() for t in texts if fast.handles(t))


@pytest.mark.parametrize(
    "changes",
    [
        {"normalizer__lowercase": False},  # cased: no accents stripped, no lower-casing
        {"normalizer__lowercase": False, "normalizer__strip_accents": True},
        {"normalizer__strip_accents": False},
        {"normalizer__handle_chinese_chars": False},  # ideographs run together as words
    ],
)
def test_other_normaliser_settings_equal_the_rust_tokenizers(
    embedder: Embedder, changes: dict
) -> None:
    tokenizer = _with(rust(embedder), **changes)
    fast = fast_path.for_tokenizer(tokenizer, embedder.info.max_length)
    assert fast is not None and fast.unicode_rules() is not None
    assert equal_to_rust(fast, tokenizer, unicode_fuzz(1500, seed=5)) > 500


def test_texts_it_does_not_handle_go_to_the_rust_tokenizer_in_order(embedder: Embedder) -> None:
    texts = [
        "plain ascii text",
        "Café au lait, naïve résumé",  # accents: stripped by the Rust normaliser
        "向量检索与语义缓存",  # CJK: one token per character there
        "a [MASK] in the text",  # special tokens are matched in raw text
        "mixed 中文 and English",
        "an ideograph outside the checked ranges: \U0002000c",
        "   ",
        "last one, plain again",
    ]
    got = embedder.tokenize(texts)
    want, truncated = embedder._encode(texts)
    assert got.ids == want
    assert got.truncated == truncated
    fast = embedder._wordpiece
    assert fast is not None
    assert [fast.handles(t) for t in texts] == [1, 1, 1, 0, 1, 0, 1, 1]
    # As arrays (the tokenizer process's answer): the same ids, empty for others.
    listed, listed_truncated, listed_others = batches.encode_taken(fast, texts)
    flat, offsets, flat_truncated, others = batches.encode_taken_flat(fast, texts)
    assert [flat[a:b].tolist() for a, b in pairwise(offsets)] == listed
    assert (flat_truncated, others) == (listed_truncated, listed_others) == (0, [3, 5])


def test_characters_the_check_disagrees_on_go_to_the_rust_tokenizer(
    monkeypatch: pytest.MonkeyPatch, embedder: Embedder
) -> None:
    """Rules read wrong for one character (here the ideographic comma as part of a
    word, where BERT makes it a word of its own): the check at load leaves that
    character out, and texts holding it go to the Rust tokenizer."""
    read = unicode_rules.unicode_rules

    def misread(spec: dict) -> unicode_rules.UnicodeRules:
        rules = read(spec)
        # "、" and what touches it read as one word, before the rules' own split.
        split = re.compile(f"[^\\s、]*、[^\\s、]*|{rules.split.pattern}")
        return dataclasses.replace(rules, split=split)

    monkeypatch.setattr(unicode_rules, "unicode_rules", misread)
    fast = fast_path.for_tokenizer(rust(embedder), embedder.info.max_length)
    assert fast is not None
    assert not fast.handles("向量、检索")
    assert fast.handles("向量，检索")
    assert equal_to_rust(fast, rust(embedder), unicode_fuzz(500)) > 100


def test_the_rust_tokenizer_can_be_chosen(monkeypatch: pytest.MonkeyPatch, embedder) -> None:
    monkeypatch.setenv(TOKENIZER_ENV, "rust")
    from pipeline.model.embedder import tokenizer_choice

    assert tokenizer_choice() == "rust"
    monkeypatch.setenv(TOKENIZER_ENV, "fastest")
    with pytest.raises(Exception, match="PIPELINE_TOKENIZER"):
        tokenizer_choice()


def test_remembered_words_stay_bounded(monkeypatch: pytest.MonkeyPatch, embedder: Embedder) -> None:
    monkeypatch.setattr(wordpiece, "MAX_REMEMBERED_WORDS", 50)
    fast = fast_path.for_tokenizer(rust(embedder), embedder.info.max_length)
    assert fast is not None
    texts = [t for t in ascii_fuzz(300, seed=11) if fast.handles(t)]
    expected = rust(embedder).encode_batch(texts, add_special_tokens=True)
    for text, want in zip(texts, expected, strict=True):
        assert fast.encode(text)[0] == want.ids
        assert len(fast._memo) <= 50
    # The batch path fills and clears the memo within one batch.
    texts = [t for t in ascii_fuzz(300, seed=12, controls=False) if fast.handles(t)]
    assert fast.encode_ascii(texts)[0] == [e.ids for e in rust(embedder).encode_batch(texts)]
    assert len(fast._memo) <= 50
    # The array path's table of chunks is cleared between batches, never within one.
    sizes = []
    for start in range(0, len(texts), 40):
        batch = texts[start : start + 40]
        flat, offsets, _, _ = batches.encode_taken_flat(fast, batch)
        expected = [e.ids for e in rust(embedder).encode_batch(batch)]
        assert [flat[a:b].tolist() for a, b in pairwise(offsets)] == expected
        sizes.append(len(fast._table._slots))
        assert sizes[-1] < 50 + len(set(" \x00 ".join(batch).lower().split()))
    assert any(later < earlier for earlier, later in pairwise(sizes))  # it was cleared


def test_a_text_with_control_characters_does_not_slow_the_rest_of_its_batch(
    monkeypatch: pytest.MonkeyPatch, embedder: Embedder
) -> None:
    fast = fast_path.for_tokenizer(rust(embedder), embedder.info.max_length)
    assert fast is not None
    texts = sample_texts(60)
    texts[7] = "form\x0cfeed " + texts[7]
    texts[41] = texts[41] + " bell\x07"
    expected = [e.ids for e in rust(embedder).encode_batch(texts, add_special_tokens=True)]
    alone: list[str] = []
    encode = fast.encode
    monkeypatch.setattr(fast, "encode", lambda text: alone.append(text) or encode(text))
    ids, _, others = batches.encode_taken(fast, texts)
    assert (ids, others, alone) == (expected, [], [texts[7], texts[41]])
    alone.clear()
    flat, offsets, _, others = batches.encode_taken_flat(fast, texts)
    assert [flat[a:b].tolist() for a, b in pairwise(offsets)] == expected
    assert (others, alone) == ([], [texts[7], texts[41]])


def _with(tokenizer: Tokenizer, **changes: object) -> Tokenizer:
    spec = json.loads(tokenizer.to_str())
    for path, value in changes.items():
        section, key = path.split("__")
        spec[section][key] = value
    return Tokenizer.from_str(json.dumps(spec))


def test_other_tokenizer_pipelines_are_refused(embedder: Embedder) -> None:
    base = rust(embedder)
    length = embedder.info.max_length
    assert fast_path.for_tokenizer(base, length) is not None
    # Control characters kept, another pre-tokenizer, another model: not BERT's pipeline.
    assert fast_path.for_tokenizer(_with(base, normalizer__clean_text=False), length) is None
    with_word = Tokenizer.from_str(base.to_str())
    with_word.add_tokens(["pipeline"])  # matched whole, even inside "pipelines"
    assert fast_path.for_tokenizer(with_word, length) is None
    other = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    other.normalizer = normalizers.Lowercase()
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    assert fast_path.for_tokenizer(other, length) is None


def test_a_fast_path_the_check_disagrees_with_is_refused(
    monkeypatch: pytest.MonkeyPatch, embedder: Embedder
) -> None:
    """If the declared pipeline reads as BERT's but the ids differ anyway, the check
    at load refuses it: here the lower-casing misread from the spec."""
    read = fast_path._from_spec

    def misread(spec: dict, max_length: int) -> wordpiece.FastWordPiece | None:
        fast = read(spec, max_length)
        if fast is not None:
            fast._lowercase = not fast._lowercase
        return fast

    monkeypatch.setattr(fast_path, "_from_spec", misread)
    assert fast_path.for_tokenizer(rust(embedder), embedder.info.max_length) is None


def test_non_ascii_rules_the_sample_check_disagrees_with_are_not_used(
    monkeypatch: pytest.MonkeyPatch, embedder: Embedder
) -> None:
    """Rules that pass the character check but misread a setting (here: no
    lower-casing for an uncased model) fail the check on whole mixed texts, made
    at the first non-ASCII text: from then on only ASCII texts are taken."""
    read = unicode_rules.unicode_rules

    def unlowered(spec: dict) -> unicode_rules.UnicodeRules:
        return dataclasses.replace(read(spec), lowercase=False)

    monkeypatch.setattr(unicode_rules, "unicode_rules", unlowered)
    fast = fast_path.for_tokenizer(rust(embedder), embedder.info.max_length)
    assert fast is not None
    assert fast.unicode is None  # not built at load: English-only work never pays for it
    assert not fast.handles("Café au lait")
    assert fast.unicode_rules() is None
    assert fast.handles("Cafe au lait")


def test_tokenize_bench_compares_both_paths_on_every_corpus(tmp_path: Path) -> None:
    """scripts/tokenize_bench.py (the figures in docs) runs, and every path (in-process
    and in one or two tokenizer processes) gave the Rust tokenizer's ids on every
    corpus, Chinese from Python's own CJK test files where the machine has no other."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "tokenize_bench.py"
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(script), "--texts", "300", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())
    found = {r["corpus"] for r in rows}
    assert {"english", "code", "logs"} <= found
    assert ("chinese" in found) == ("mixed" in found)
    assert all(r["ids_equal"] and r["taken"] > 0.5 for r in rows), rows
    for key in ("rust_cold_us", "fast_warm_us", "process2_rust_warm_us", "process1_fast_cold_us"):
        assert all(r[key] > 0 for r in rows), (key, rows)


_PADDING = {
    "strategy": "BatchLongest", "direction": "Left", "pad_to_multiple_of": None, "pad_id": 0,
    "pad_type_id": 0, "pad_token": "[PAD]",
}  # fmt: skip


def _truncating(tokenizer: Tokenizer, max_length: int, direction: str = "right") -> Tokenizer:
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.enable_truncation(max_length, direction=direction)
    return copy


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda s: s["truncation"].update(direction="Left"), "truncates on the left"),
        (lambda s: s["truncation"].update(stride=4), "without stride"),
        (lambda s: s["truncation"].update(max_length=64), "not at 256 tokens"),
        (lambda s: s["truncation"].update(strategy="OnlySecond"), "strategy"),
        (lambda s: s.update(truncation=None), "does not truncate"),
        (lambda s: s.update(padding=_PADDING), "pads"),
        # Keys of a later `tokenizers` (this one drops them when it reads the JSON).
        (lambda s: s["normalizer"].update(some_new_setting=True), "normaliser"),
        (lambda s: s["model"].update(some_new_setting=True), "model"),
        (lambda s: s.update(some_new_section={}), "unknown tokenizer settings"),
        (lambda s: s["post_processor"]["special_tokens"]["[CLS]"].update(ids=[5]), "[CLS]"),
        (lambda s: s["post_processor"]["single"][1]["Sequence"].update(id="B"), "[CLS] text"),
    ],
)
def test_a_setting_the_fast_path_does_not_reproduce_leaves_it(
    embedder: Embedder, edit: Callable[[dict], object], named: str
) -> None:
    """Every setting of the serialised tokenizer that decides the ids is read: one the
    fast path does not reproduce (truncation_side left among them) leaves every text
    to the Rust tokenizer, and says why."""
    length = embedder.info.max_length
    spec = json.loads(rust(embedder).to_str())
    assert fast_path.declined(spec, length) is None
    edit(spec)
    assert named in (fast_path.declined(spec, length) or "")
    if "some_new" not in json.dumps(spec):
        assert fast_path.for_tokenizer(Tokenizer.from_str(json.dumps(spec)), length) is None


@pytest.mark.parametrize("limit", [2, 3, 16, 512, 2048, 8192])
def test_the_check_at_load_cuts_at_the_tokenizers_own_limit(
    embedder: Embedder, limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the limit (2,048 included, past every text of the old sample), the
    check at load takes texts just under, at, just over and far past it, ASCII and
    not: a fast path that cut the other end, or one token late, is refused by the
    check alone."""
    tokenizer = _truncating(rust(embedder), limit)
    fast = fast_path.for_tokenizer(tokenizer, limit)
    assert fast is not None and fast.unicode_rules() is not None
    checked: dict[str, list[str]] = {}
    agrees = fast_path._agrees

    def spy(fast: wordpiece.FastWordPiece, rust: Tokenizer, texts, what: str = "sample") -> bool:
        checked[what] = list(texts)
        return agrees(fast, rust, checked[what], what)

    monkeypatch.setattr(fast_path, "_agrees", spy)
    again = fast_path.for_tokenizer(tokenizer, limit)
    assert again is not None and again.unicode_rules() is not None
    untruncated = Tokenizer.from_str(tokenizer.to_str())
    untruncated.no_truncation()
    for what, ascii in (("sample", True), ("mixed-script", False)):
        lengths = [
            len(untruncated.encode(t).ids) for t in checked[what] if again.handles(t)
            and t.isascii() == ascii
        ]  # fmt: skip
        # Words of one token each, one less than the limit takes (none: "" is ASCII), as
        # many, one more.
        assert {n + 2 for n in (limit - 3, limit - 2, limit - 1) if n > 0} <= set(lengths), what
        assert max(lengths) > limit, what

    # The other end kept (truncation_side left, were it not read): the check refuses it
    # (at 2, [CLS] [SEP] alone, both ends are the same).
    monkeypatch.setattr(fast_path, "_agrees", agrees)
    monkeypatch.setattr(fast_path, "_truncation_declined", lambda truncation, length: None)
    left = fast_path.for_tokenizer(_truncating(rust(embedder), limit, "left"), limit)
    assert (left is None) == (limit > 2)
    # One token late: refused too.
    init = wordpiece.FastWordPiece.__init__

    def late(self: wordpiece.FastWordPiece, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        self._max_body += 1

    monkeypatch.setattr(wordpiece.FastWordPiece, "__init__", late)
    assert fast_path.for_tokenizer(tokenizer, limit) is None


def test_non_ascii_texts_cut_one_token_late_leave_the_non_ascii_rules(
    embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check of the non-ASCII rules has texts past the limit of its own: a cut
    that differs there alone (here one token late) leaves non-ASCII text to Rust."""
    tokenizer = _truncating(rust(embedder), 2048)
    fast = fast_path.for_tokenizer(tokenizer, 2048)
    assert fast is not None
    flat = fast.encode_unicode_flat
    encode = fast.encode

    def late(texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
        fast._max_body += 1
        try:
            return flat(texts)
        finally:
            fast._max_body -= 1

    def late_one(text: str) -> tuple[list[int], bool]:
        if text.isascii():
            return encode(text)
        fast._max_body += 1
        try:
            return encode(text)
        finally:
            fast._max_body -= 1

    monkeypatch.setattr(fast, "encode_unicode_flat", late)
    monkeypatch.setattr(fast, "encode", late_one)
    assert fast.unicode_rules() is None
    assert not fast.handles("向量检索") and fast.handles("plain text")


def test_an_unreadable_tokenizer_is_a_bug_not_a_silent_fallback() -> None:
    """Only what is not reproduced leaves the fast path quietly; anything but a
    tokenizers.Tokenizer is a programming error and raises."""
    with pytest.raises(AttributeError):
        fast_path.for_tokenizer(object(), 128)
