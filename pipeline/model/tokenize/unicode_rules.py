"""The fast path's rules for text that is not ASCII, and the check that takes a
character only once it is shown to be treated exactly as the Rust normaliser and
pre-tokeniser treat it.

Most of a Chinese or mixed-language corpus is not ASCII: characters of Unicode's
"other" categories dropped, accents stripped (NFD, then nonspacing marks removed)
where the model is uncased, each CJK ideograph a word of its own, every Unicode
punctuation mark a word. Python's Unicode tables are not the Rust crates' (they
differ in version), so each character is judged against the Rust tokenizer when a
text first brings it (`CharacterCheck`, a few µs a character).
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.model.tokenize.text import END_ID, PUNCTUATION, TEXT_END
from pipeline.model.tokenize.word_split import WordSplitter, code_points

# The non-ASCII characters offered to the fast path (each judged when first met):
# Latin, Greek, Cyrillic, Armenian, Hebrew, Arabic, Devanagari, Thai, general and
# CJK punctuation, symbols, kana, CJK ideographs, Hangul, full-width forms, emoji
# (48k characters in all).
CANDIDATE_RANGES = (
    (0x80, 0x6FF),
    (0x900, 0x97F),
    (0xE00, 0xE7F),
    (0x1E00, 0x1FFF),
    (0x2000, 0x206F),
    (0x20A0, 0x20CF),
    (0x2100, 0x27BF),
    (0x3000, 0x33FF),
    (0x3400, 0x4DBF),
    (0x4E00, 0x9FFF),
    (0xAC00, 0xD7A3),
    (0xFF00, 0xFFEF),
    (0x1F300, 0x1F64F),
    (0x1F680, 0x1F6FF),
    (0x1F900, 0x1F9FF),
)
# BertNormalizer's handle_chinese_chars: each of these is made a word of its own.
_CJK_RANGES = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B920, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)
# Lower-cased by context in Python (a final sigma), by character in Rust.
_CONTEXTUAL_CASE = "\u03a3"


@dataclass(frozen=True)
class UnicodeRules:
    """BertNormalizer and BertPreTokenizer for non-ASCII text, in the Rust order:
    drop "other" characters, strip accents (NFD, then nonspacing marks), lower-case;
    then words are CJK ideographs, punctuation marks and runs of anything else,
    split at whitespace. The classes come from Python's Unicode tables for the
    Basic Multilingual Plane (a class reaching past it is scanned range by range,
    30 times slower); `CharacterCheck` takes only characters they serve right."""

    dropped: re.Pattern[str]
    dropped_but_end: re.Pattern[str]  # `dropped` but the end mark of joined texts
    # By code point: characters normalisation leaves as they are but for case.
    unchanged: np.ndarray = field(compare=False)
    marks: re.Pattern[str] | None  # nonspacing marks, where accents are stripped
    lowercase: bool
    split: re.Pattern[str]
    alone: re.Pattern[str]  # the characters `split` makes words alone

    def splitter(self, piece_of: Callable[[str], list[int]]) -> WordSplitter:
        """`split` in numpy, for joined texts (`joined_normalized`)."""
        return WordSplitter(self.alone, piece_of, {TEXT_END: END_ID})

    def words(self, text: str) -> list[str]:
        return self.split.findall(self._normalized(text, self.dropped))

    def joined_normalized(self, texts: list[str]) -> str | None:
        """The texts normalised, an end mark between two texts (between spaces, a word
        of its own): split, the same words as `words` of each (every rule works
        character by character but NFD's reordering of marks, and the spaces around
        the end mark stop that). None where a text has an end mark of its own."""
        joined = f" {TEXT_END} ".join(texts)
        if joined.count(TEXT_END) != len(texts) - 1:
            return None
        if self.unchanged[code_points(joined)].all():  # most polls: three passes spared
            return joined.lower() if self.lowercase else joined
        return self._normalized(joined, self.dropped_but_end)

    def _normalized(self, text: str, dropped: re.Pattern[str]) -> str:
        if dropped.search(text):
            text = dropped.sub("", text)
        if self.marks is not None:
            text = self.marks.sub("", unicodedata.normalize("NFD", text))
        if self.lowercase:
            text = text.lower()
        return text


class CharacterCheck:
    """Which non-ASCII characters the rules treat exactly as the Rust normaliser and
    pre-tokeniser do, judged one by one as texts bring them: "a" + character + "a"
    must come out as the same words both ways (a few µs a character, once; a Chinese
    corpus meets a few thousand). Only characters of CANDIDATE_RANGES are judged."""

    MAX_REFUSED = 50_000  # forgotten past this (judged again when met): memory stays bounded

    def __init__(self, rules: UnicodeRules, normalize: Any, pre_tokenize: Any) -> None:
        self._rules = rules
        self._normalize = normalize
        self._pre_tokenize = pre_tokenize
        self._taken = {chr(code) for code in range(0x80)}
        # The same as a table by code point, to look a poll's characters up at once.
        self._taken_codes = np.zeros(0x110000, bool)
        self._taken_codes[:0x80] = True
        self._refused: set[str] = set()

    def takes_all(self, texts: list[str]) -> list[bool]:
        """`takes` of each text: every character looked up in numpy, and only the
        texts with one not taken yet checked (and their new characters judged) one by
        one. A few nanoseconds a character, against a set of each text's."""
        # A lone surrogate is never taken: its text goes to `takes` (and the Rust tokenizer).
        outside = np.flatnonzero(~self._taken_codes[code_points("".join(texts))])
        verdicts = [True] * len(texts)
        if len(outside):
            ends = np.cumsum(np.fromiter(map(len, texts), np.int64, len(texts)))
            for i in np.unique(np.searchsorted(ends, outside, side="right")).tolist():
                verdicts[i] = self.takes(texts[i])
        return verdicts

    def takes(self, text: str) -> bool:
        unseen = set(text)
        unseen -= self._taken
        if not unseen:
            return True
        if not unseen.isdisjoint(self._refused):
            return False
        return all([self._judge(char) for char in unseen])  # every one judged, remembered

    def _judge(self, char: str) -> bool:
        probe = f"a{char}a"
        agrees = _is_candidate(char, self._rules.lowercase) and self._rules.words(probe) == [
            word for word, _ in self._pre_tokenize(self._normalize(probe))
        ]
        if agrees:
            self._taken.add(char)
            self._taken_codes[ord(char)] = True
        else:
            if len(self._refused) >= self.MAX_REFUSED:
                self._refused.clear()
            self._refused.add(char)
        return agrees


def character_check(
    spec: dict[str, Any], rust_tokenizer: Any
) -> tuple[UnicodeRules, CharacterCheck] | None:
    normalizer, pre_tokenizer = rust_tokenizer.normalizer, rust_tokenizer.pre_tokenizer
    if normalizer is None or pre_tokenizer is None:
        return None
    rules = unicode_rules(spec)
    return rules, CharacterCheck(rules, normalizer.normalize_str, pre_tokenizer.pre_tokenize_str)


def unicode_rules(spec: dict[str, Any]) -> UnicodeRules:
    """Rules from the normaliser's settings and Python's Unicode tables."""
    normalizer = spec["normalizer"]
    lowercase = bool(normalizer.get("lowercase"))
    strip = normalizer.get("strip_accents")
    strip_accents = lowercase if strip is None else bool(strip)
    dropped, dropped_but_end, punctuation, marks = _bmp_classes()
    cjk = ""
    if normalizer.get("handle_chinese_chars", True):
        bmp = [(first, last) for first, last in _CJK_RANGES if last <= 0xFFFF]
        cjk = _chars_class(chr(code) for first, last in bmp for code in range(first, last + 1))
    punct = PUNCTUATION[1:-1] + punctuation
    return UnicodeRules(
        alone=re.compile(f"[{punct}{cjk}]"),
        dropped=re.compile(f"[{dropped}]"),
        dropped_but_end=re.compile(f"[{dropped_but_end}]"),
        unchanged=_unchanged_codes(strip_accents),
        marks=re.compile(f"[{marks}]") if strip_accents else None,
        lowercase=lowercase,
        split=re.compile(f"[{punct}{cjk}]|[^\\s{punct}{cjk}]+"),
    )


@functools.cache
def _bmp_classes() -> tuple[str, str, str, str]:
    """Regex class bodies over the Basic Multilingual Plane: what clean_text drops
    ("other" categories but tab, newline and carriage return; U+FFFD), the same but
    the end mark of joined texts, punctuation, nonspacing marks."""
    category = {chr(code): unicodedata.category(chr(code)) for code in range(0x10000)}
    dropped = [c for c, k in category.items() if _is_dropped(c, k)]
    punctuation = [c for c, k in category.items() if k[0] == "P"]
    marks = [c for c, k in category.items() if k == "Mn"]
    return (
        _chars_class(dropped),
        _chars_class(c for c in dropped if c != TEXT_END),
        _chars_class(punctuation),
        _chars_class(marks),
    )


def _is_dropped(char: str, category: str) -> bool:
    """What clean_text drops: "other" categories but tab, newline and carriage
    return, and U+FFFD."""
    return (category[0] == "C" and char not in "\t\n\r") or char == "\ufffd"


@functools.cache
def _unchanged_codes(strip_accents: bool) -> np.ndarray:
    """By code point: whether normalisation leaves a character as it is but for case,
    over the Basic Multilingual Plane (not dropped; where accents are stripped, not
    a mark, not decomposed by NFD, not reordered by it); the end mark too."""
    unchanged = np.zeros(0x110000, bool)
    for code in range(0x10000):
        char = chr(code)
        category = unicodedata.category(char)
        if _is_dropped(char, category):
            continue
        if strip_accents and (
            category == "Mn"
            or unicodedata.combining(char)
            or unicodedata.normalize("NFD", char) != char
        ):
            continue
        unchanged[code] = True
    unchanged[ord(TEXT_END)] = True
    unchanged.flags.writeable = False  # shared by every tokenizer
    return unchanged


def _is_candidate(char: str, lowercase: bool) -> bool:
    code = ord(char)
    if not any(first <= code <= last for first, last in CANDIDATE_RANGES):
        return False
    # Unassigned here may be assigned in the Rust tables, and the other way round.
    if unicodedata.category(char) == "Cn":
        return False
    return not (lowercase and char in _CONTEXTUAL_CASE)


def _chars_class(chars: Iterable[str]) -> str:
    """A regex character class body for these characters, as ranges of consecutive ones."""
    codes = sorted({ord(c) for c in chars})
    parts = []
    start = previous = None
    for code in [*codes, None]:
        if code is not None and previous is not None and code == previous + 1:
            previous = code
            continue
        if start is not None:
            assert previous is not None
            span = _escape(chr(start))
            parts.append(span if start == previous else f"{span}-{_escape(chr(previous))}")
        start = previous = code
    return "".join(parts)


def _escape(char: str) -> str:
    return f"\\U{ord(char):08x}"
