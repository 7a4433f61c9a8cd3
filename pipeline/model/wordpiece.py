"""BERT's WordPiece in a few microseconds a text: the same ids as the Rust tokenizer.

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
their own tokenizer.json), and only texts without "[" (special tokens such as
"[MASK]" are matched in the raw text); everything else goes to the Rust
tokenizer. At load the two are compared on a built-in sample and the fast path
is refused unless every id agrees.

Most of a Chinese or mixed-language corpus is not ASCII, and for those texts
the rules are a few more: characters of Unicode's "other" categories dropped,
accents stripped (NFD, then nonspacing marks removed) where the model is
uncased, each CJK ideograph a word of its own, every Unicode punctuation mark a
word. Python's Unicode tables are not the Rust crates' (they differ in version),
so the characters this path takes are the ones it was shown to treat exactly as
the Rust normaliser and pre-tokeniser do, one by one as texts bring them
(`_CharacterCheck`, a few µs a character): a text with any other character goes to
the Rust tokenizer.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain, pairwise, repeat
from typing import Any

import numpy as np

from pipeline.model.word_split import WordSplitter, code_points

log = logging.getLogger(__name__)

# What BertNormalizer's clean_text removes from ASCII (tab, newline and carriage
# return are whitespace and stay, as separators).
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# BERT's punctuation in ASCII: every printable character that is not a letter or digit.
_PUNCTUATION = r"[!-/:-@\[-`{-~]"
_UNCASED_WORDS = re.compile(rf"[a-z0-9]+|{_PUNCTUATION}")
_CASED_WORDS = re.compile(rf"[A-Za-z0-9]+|{_PUNCTUATION}")
# Many ASCII texts are tokenized as one string, split at whitespace; a NUL between
# spaces marks where a text ends (a text with a NUL of its own goes alone: clean_text
# drops it). The end mark's "pieces" are -1: no vocabulary id is negative.
_TEXT_END = "\x00"
_END_ID = -1
# Printable ASCII and the whitespace BERT splits at (where Python's split agrees):
# a joined string of these and end marks alone can be split with str.split().
_PLAIN_ASCII = bytes(range(0x20, 0x7F)) + b"\t\n\r"
# The memo of word -> pieces: the common words of a corpus, a few MB at most.
MAX_REMEMBERED_WORDS = 50_000

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


class FastWordPiece:
    """Token ids (with [CLS] and [SEP], truncated to `max_length`) of the texts
    `handles` accepts: ASCII, and texts of the non-ASCII characters `_CharacterCheck`
    has taken."""

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
        self._lowercase = lowercase
        self._words = _UNCASED_WORDS if lowercase else _CASED_WORDS
        # A word met for the first time is cut by the Rust tokenizer's own WordPiece
        # model (nothing around it: the word is already normalised and split), all the
        # new words of a poll in one call: cutting them here, in Python, cost several
        # times the Rust tokenizer's time on corpora of new words (ids, hashes, names).
        self._word_model = _word_model(vocab, unk, prefix, max_word_chars)
        self._unk = vocab[unk]
        self._cls = vocab[cls]
        self._sep = vocab[sep]
        self._max_body = max_length - 2
        self._memo: dict[str, list[int]] = {_TEXT_END: [_END_ID]}
        self._table = _PieceTable()
        self._specials: re.Pattern[str] | None = None
        self.unicode: _UnicodeRules | None = None
        self._characters: _CharacterCheck | None = None
        self._splitter: WordSplitter | None = None
        # What the non-ASCII rules are built from and checked against, at the first
        # non-ASCII text: English-only work never pays for them.
        self._unicode_source: tuple[dict[str, Any], Any] | None = None
        self._unicode_lock = threading.Lock()

    def handles(self, text: str) -> bool:
        if self._may_hold_special(text):
            return False
        if text.isascii():
            return True
        if self._unicode_source is not None:
            self.unicode_rules()
        return self._characters is not None and self._characters.takes(text)

    def handles_many(self, texts: list[str]) -> list[bool]:
        """`handles` of each text; the non-ASCII ones' characters looked up all at
        once (`_CharacterCheck.takes_all`), not a set a text."""
        taken = [text.isascii() for text in texts]
        non_ascii = [i for i, ascii in enumerate(taken) if not ascii]
        if non_ascii:
            if self._unicode_source is not None:
                self.unicode_rules()
            if self._characters is not None:
                verdicts = self._characters.takes_all([texts[i] for i in non_ascii])
                for i, verdict in zip(non_ascii, verdicts, strict=True):
                    taken[i] = verdict
        for i, text in enumerate(texts):
            if taken[i] and self._may_hold_special(text):
                taken[i] = False
        return taken

    def _may_hold_special(self, text: str) -> bool:
        """Whether the text may hold one of the added tokens (see `match_specials`)."""
        return "[" in text and (self._specials is None or self._specials.search(text) is not None)

    def unicode_rules(self) -> _UnicodeRules | None:
        """The non-ASCII rules, built and checked on first use (30 ms); None where
        the check on mixed texts found a difference (then only ASCII is taken)."""
        with self._unicode_lock:
            if self._unicode_source is not None:
                spec, rust_tokenizer = self._unicode_source
                self._unicode_source = None
                checks = _character_check(spec, rust_tokenizer)
                if checks is not None:
                    self.unicode, self._characters = checks
                    self._splitter = self.unicode.splitter(self._word_pieces)
                    if not _agrees(self, rust_tokenizer, _mixed_texts()):
                        self.unicode = self._characters = self._splitter = None
                self.forget_words()  # the samples' words are not the corpus's
        return self.unicode

    def forget_words(self) -> None:
        self._memo.clear()
        self._memo[_TEXT_END] = [_END_ID]

    def match_specials(self, added_tokens: list[dict[str, Any]]) -> None:
        """Texts with "[" are left to the Rust tokenizer only where they hold one of
        these added tokens (each contains "["), not all of them: where tokens are
        matched on the raw text (normalized false) that is a plain substring test.
        A token matched after normalisation keeps every "[" text on the Rust path."""
        if any(token.get("normalized", True) for token in added_tokens):
            self._specials = None
        else:
            contents = sorted({token["content"] for token in added_tokens})
            self._specials = re.compile("|".join(map(re.escape, contents)))

    def encode(self, text: str) -> tuple[list[int], bool]:
        """(ids, whether the text was truncated) of a text that `handles` accepts."""
        if text.isascii():
            words = self._ascii_words(text)
        else:
            assert self.unicode is not None
            words = self.unicode.words(text)
        found = list(map(self._memo.get, words))
        if None in found:
            self._learn(words)
            found = [self._memo.get(word) or self._pieces(word) for word in words]
        ids = [self._cls, *chain.from_iterable(found)]
        truncated = len(ids) - 1 > self._max_body
        if truncated:
            del ids[self._max_body + 1 :]
        ids.append(self._sep)
        return ids, truncated

    def encode_ascii(self, texts: list[str]) -> tuple[list[list[int]], int]:
        """`encode` of many ASCII texts that `handles` accepts: (ids, how many were
        truncated). They are joined, lower-cased and split at whitespace at once, and
        each whitespace-delimited chunk ("fox.", "(e.g.)") is looked up whole: a
        third of the CPU of a regex pass per text, which was most of its cost."""
        if not texts:
            return [], 0
        flat = self._ascii_pieces(texts)
        if flat is not None:
            return self._split_at_ends(flat, len(texts))
        # Texts with control characters go one at a time, the others still at once.
        clean, controls = _partition(texts, _has_controls)
        ids: list[list[int]] = [[]] * len(texts)
        ids_of_clean, truncated = self.encode_ascii([texts[i] for i in clean])
        for i, one in zip(clean, ids_of_clean, strict=True):
            ids[i] = one
        for i in controls:
            ids[i], cut = self.encode(texts[i])
            truncated += cut
        return ids, truncated

    def encode_ascii_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
        """`encode_ascii` as arrays: every text's ids end to end (int32), the offsets
        where each text's ids start (and the last ends), and how many were truncated;
        the ends are placed in numpy, not text by text. Texts with control
        characters go one at a time, the others still at once."""
        return self._encode_flat(texts, self._ascii_joined_pieces, _has_controls)

    def encode_unicode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
        """`encode_ascii_flat` for texts `handles` accepts that are not ASCII: they are
        joined, normalised and split into words at once (`WordSplitter`, not a regex
        pass a text), and their words' pieces gathered from arrays. A text with a NUL
        of its own goes alone (NUL marks where a joined text ends)."""
        return self._encode_flat(texts, self._unicode_joined_pieces, _has_end_mark)

    def _encode_flat(
        self,
        texts: list[str],
        joined_pieces: Callable[[list[str]], np.ndarray | None],
        goes_alone: Callable[[str], bool],
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """The texts' ids as arrays: `joined_pieces` gives the texts' pieces end to end,
        _END_ID between two texts (None where one of them `goes_alone`)."""
        if not texts:
            return np.zeros(0, np.int32), np.zeros(1, np.int64), 0
        with self._table.lock:
            pieces = joined_pieces(texts)
        if pieces is not None:
            return self._arrays_at_ends(pieces, len(texts))
        together, by_themselves = _partition(texts, goes_alone)
        assert by_themselves, "joined_pieces and goes_alone disagree"
        alone, truncated = _encoded_alone(self, texts, by_themselves)
        groups = [alone]
        if together:
            ids, offsets, cut = self._encode_flat(
                [texts[i] for i in together], joined_pieces, goes_alone
            )
            groups.append((together, ids, offsets))
            truncated += cut
        return (*_merged(len(texts), groups), truncated)

    def _ascii_joined_pieces(self, texts: list[str]) -> np.ndarray | None:
        # The chunks' pieces gathered from arrays (a dict lookup a chunk), not joined
        # as Python lists: a third less CPU a text.
        chunks = self._ascii_chunks(texts)
        if chunks is None:
            return None
        return self._table.pieces(chunks, self._memo_pieces, self._learn_chunks)[0]

    def _unicode_joined_pieces(self, texts: list[str]) -> np.ndarray | None:
        rules, splitter = self.unicode, self._splitter
        assert rules is not None and splitter is not None
        joined = rules.joined_normalized(texts)
        if joined is None:
            return None
        words = splitter.split(joined)
        return words.pieces(*self._table.pieces(words.runs, self._word_pieces, self._learn))

    def _ascii_chunks(self, texts: list[str]) -> list[str] | None:
        """The texts' whitespace-delimited chunks in turn, an end mark between two
        texts; None where a text has control characters."""
        joined = f" {_TEXT_END} ".join(texts)
        if len(joined.encode("ascii").translate(None, _PLAIN_ASCII)) != len(texts) - 1:
            return None
        if self._lowercase:
            joined = joined.lower()
        return joined.split()

    def _ascii_pieces(self, texts: list[str]) -> list[int] | None:
        """Every text's pieces, without [CLS] and [SEP], _END_ID between two texts."""
        chunks = self._ascii_chunks(texts)
        if chunks is None:
            return None
        try:
            return list(chain.from_iterable(map(self._memo.get, chunks)))
        except TypeError:  # a chunk not met before (None)
            self._learn_chunks([chunk for chunk in chunks if chunk not in self._memo])
            return list(chain.from_iterable(map(self._memo_pieces, chunks)))

    def _memo_pieces(self, chunk: str) -> list[int]:
        return self._memo.get(chunk) or self._chunk_pieces(chunk)

    def _word_pieces(self, word: str) -> list[int]:
        return self._memo.get(word) or self._pieces(word)

    def _arrays_at_ends(self, pieces: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray, int]:
        ends = np.flatnonzero(pieces == _END_ID)
        starts = np.concatenate(([0], ends + 1))
        lengths = np.concatenate((ends, [len(pieces)])) - starts
        kept = np.minimum(lengths, self._max_body)
        offsets = np.zeros(count + 1, np.int64)
        np.cumsum(kept + 2, out=offsets[1:])
        ids = np.empty(int(offsets[-1]), np.int32)
        body = np.ones(len(ids), bool)
        body[offsets[:-1]] = body[offsets[1:] - 1] = False
        ids[offsets[:-1]] = self._cls
        ids[offsets[1:] - 1] = self._sep
        # A kept piece's place in `ids` less its place in `pieces`: one shift a text.
        at = np.flatnonzero(body)
        ids[at] = pieces[at - np.repeat(offsets[:-1] + 1 - starts, kept)]
        return ids, offsets, int(np.count_nonzero(lengths > self._max_body))

    def _chunk_pieces(self, chunk: str) -> list[int]:
        """The pieces of a whitespace-free ASCII string: its words' pieces in turn.
        (Memo keys are words or such chunks: either way a key's pieces depend on the
        key alone.)"""
        words = self._words.findall(chunk)
        if len(words) == 1 and words[0] == chunk:
            return self._pieces(chunk)
        pieces = list(chain.from_iterable(self._memo.get(w) or self._pieces(w) for w in words))
        self._remember(chunk, pieces)
        return pieces

    def _learn_chunks(self, chunks: list[str]) -> None:
        """Learns the new words of these ASCII chunks all at once (see `_learn`), then
        the chunks' pieces."""
        split = [(c, self._words.findall(c)) for c in chunks if c not in self._memo]
        self._learn([word for _, words in split for word in words])
        for chunk, words in split:
            if words != [chunk]:  # a chunk of one word is that word's memo entry
                found = (self._memo.get(word) or self._pieces(word) for word in words)
                self._remember(chunk, list(chain.from_iterable(found)))

    def _learn(self, words: list[str]) -> None:
        """Cuts the words not met before into pieces with one call of the Rust
        WordPiece model and remembers them (as many as the memo holds: the callers
        cut any word it lacks on its own)."""
        unique = list(dict.fromkeys(words))
        new = [word for word in unique if word not in self._memo]
        if not new:
            return
        if len(self._memo) + len(new) > MAX_REMEMBERED_WORDS:
            self.forget_words()  # rare; the common words come back at once
            new = unique[: MAX_REMEMBERED_WORDS - len(self._memo)]
        for word, encoding in zip(new, self._word_model.encode_batch(new), strict=True):
            self._memo[word] = encoding.ids

    def _split_at_ends(self, flat: list[int], count: int) -> tuple[list[list[int]], int]:
        cls, sep, max_body = self._cls, self._sep, self._max_body
        out: list[list[int]] = []
        truncated = 0
        start = 0
        for n in range(count):
            end = flat.index(_END_ID, start) if n < count - 1 else len(flat)
            body = flat[start:end] if end - start <= max_body else flat[start : start + max_body]
            truncated += end - start > max_body
            body.insert(0, cls)
            body.append(sep)
            out.append(body)
            start = end + 1
        return out, truncated

    def _ascii_words(self, text: str) -> list[str]:
        if _CONTROL.search(text):
            text = _CONTROL.sub("", text)
        if self._lowercase:
            text = text.lower()
        return self._words.findall(text)

    def _pieces(self, word: str) -> list[int]:
        pieces: list[int] = self._word_model.encode(word).ids
        self._remember(word, pieces)
        return pieces

    def _remember(self, key: str, pieces: list[int]) -> None:
        if len(self._memo) >= MAX_REMEMBERED_WORDS:
            self.forget_words()  # rare; the common words come back at once
        self._memo[key] = pieces


class _PieceTable:
    """Chunks' pieces as arrays: a slot a chunk, every slot's pieces end to end.

    Derived from the memo (a chunk's pieces depend on the chunk alone), so it
    may be cleared at any time but in the middle of a gather; it is, when it
    holds MAX_REMEMBERED_WORDS chunks as a gather starts.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()  # a gather grows the arrays it reads
        self._clear()

    def _clear(self) -> None:
        self._slots: dict[str, int] = {}
        self._starts = np.zeros(1024, np.int64)
        self._lengths = np.zeros(1024, np.int64)
        self._data = np.zeros(4096, np.int32)
        self._filled = 0

    def pieces(
        self,
        chunks: list[str],
        pieces_of: Callable[[str], list[int]],
        learn: Callable[[list[str]], None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The chunks' pieces end to end (int32) and how many each has; `pieces_of`
        gives a new chunk's, after `learn` was told all the new ones at once."""
        if len(self._slots) >= MAX_REMEMBERED_WORDS:
            self._clear()
        slots = np.fromiter(map(self._slots.get, chunks, repeat(-1)), np.int64, len(chunks))
        missing = np.flatnonzero(slots < 0)
        if len(missing):
            # Added all at once: a corpus's tail brings new chunks in most polls.
            new = [chunks[i] for i in missing.tolist()]
            unique = list(dict.fromkeys(new))
            if learn is not None:
                learn(unique)
            self._add(unique, pieces_of)
            slots[missing] = list(map(self._slots.__getitem__, new))
        lengths = self._lengths[slots]
        ends = np.cumsum(lengths)
        if not len(ends) or not ends[-1]:
            return np.zeros(0, np.int32), lengths
        # Piece k of chunk i sits at starts[i] + k; out there at ends[i] - lengths[i] + k.
        shift = np.repeat(self._starts[slots] - (ends - lengths), lengths)
        return self._data[np.arange(int(ends[-1])) + shift], lengths

    def _add(self, chunks: list[str], pieces_of: Callable[[str], list[int]]) -> None:
        found = list(map(pieces_of, chunks))
        lengths = np.fromiter(map(len, found), np.int64, len(found))
        first, count = len(self._slots), len(self._slots) + len(chunks)
        if count > len(self._starts):
            self._starts = np.resize(self._starts, max(2 * len(self._starts), count))
            self._lengths = np.resize(self._lengths, len(self._starts))
        filled = self._filled + int(lengths.sum())
        if filled > len(self._data):
            self._data = np.resize(self._data, max(2 * len(self._data), filled))
        self._data[self._filled : filled] = np.fromiter(
            chain.from_iterable(found), np.int32, filled - self._filled
        )
        self._starts[first:count] = self._filled + np.cumsum(lengths) - lengths
        self._lengths[first:count] = lengths
        self._slots.update(zip(chunks, range(first, count), strict=True))
        self._filled = filled


@dataclass(frozen=True)
class _UnicodeRules:
    """BertNormalizer and BertPreTokenizer for non-ASCII text, in the Rust order:
    drop "other" characters, strip accents (NFD, then nonspacing marks), lower-case;
    then words are CJK ideographs, punctuation marks and runs of anything else,
    split at whitespace. The classes come from Python's Unicode tables for the
    Basic Multilingual Plane (a class reaching past it is scanned range by range,
    30 times slower); `_CharacterCheck` takes only characters they serve right."""

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
        return WordSplitter(self.alone, piece_of, {_TEXT_END: _END_ID})

    def words(self, text: str) -> list[str]:
        return self.split.findall(self._normalized(text, self.dropped))

    def joined_normalized(self, texts: list[str]) -> str | None:
        """The texts normalised, an end mark between two texts (between spaces, a word
        of its own): split, the same words as `words` of each (every rule works
        character by character but NFD's reordering of marks, and the spaces around
        the end mark stop that). None where a text has an end mark of its own."""
        joined = f" {_TEXT_END} ".join(texts)
        if joined.count(_TEXT_END) != len(texts) - 1:
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


class _CharacterCheck:
    """Which non-ASCII characters the rules treat exactly as the Rust normaliser and
    pre-tokeniser do, judged one by one as texts bring them: "a" + character + "a"
    must come out as the same words both ways (about 6 µs a character; a Chinese
    corpus meets a few thousand). Only characters of CANDIDATE_RANGES are judged."""

    MAX_REFUSED = 50_000  # forgotten past this (judged again when met): memory stays bounded

    def __init__(self, rules: _UnicodeRules, normalize: Any, pre_tokenize: Any) -> None:
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


def _character_check(
    spec: dict[str, Any], rust_tokenizer: Any
) -> tuple[_UnicodeRules, _CharacterCheck] | None:
    try:
        normalize = rust_tokenizer.normalizer.normalize_str
        pre_tokenize = rust_tokenizer.pre_tokenizer.pre_tokenize_str
    except AttributeError:
        return None
    rules = _unicode_rules(spec)
    return rules, _CharacterCheck(rules, normalize, pre_tokenize)


def _unicode_rules(spec: dict[str, Any]) -> _UnicodeRules:
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
    punct = _PUNCTUATION[1:-1] + punctuation
    return _UnicodeRules(
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
        _chars_class(c for c in dropped if c != _TEXT_END),
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
    unchanged[ord(_TEXT_END)] = True
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


def _word_model(vocab: dict[str, int], unk: str, prefix: str, max_word_chars: int) -> Any:
    """A Rust tokenizer of the WordPiece model alone: a normalised word in, its pieces out."""
    from tokenizers import Tokenizer, models

    return Tokenizer(
        models.WordPiece(
            vocab,
            unk_token=unk,
            continuing_subword_prefix=prefix,
            max_input_chars_per_word=max_word_chars,
        )
    )


def _escape(char: str) -> str:
    return f"\\U{ord(char):08x}"


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
    ids, offsets = _merged(len(texts), groups)
    return ids, offsets, truncated, others


def encode_rust_flat(
    rust_tokenizer: Any, texts: list[str]
) -> tuple[np.ndarray, np.ndarray, int, list[int]]:
    """`encode_taken_flat`'s arrays, every text through the Rust tokenizer."""
    encodings = rust_tokenizer.encode_batch(texts, add_special_tokens=True)
    ids, offsets = _end_to_end([e.ids for e in encodings])
    return ids, offsets, sum(bool(e.overflowing) for e in encodings), []


def _partition(texts: list[str], goes_alone: Callable[[str], bool]) -> tuple[list[int], list[int]]:
    """The indices of the texts that may be tokenized joined with others, and of
    those that go alone."""
    together: list[int] = []
    alone: list[int] = []
    for i, text in enumerate(texts):
        (alone if goes_alone(text) else together).append(i)
    return together, alone


def _has_controls(text: str) -> bool:
    """An ASCII text with characters BERT drops (it cannot be split joined with others)."""
    return bool(text.encode("ascii").translate(None, _PLAIN_ASCII))


def _has_end_mark(text: str) -> bool:
    return _TEXT_END in text


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


def _encoded_alone(
    fast: FastWordPiece, texts: list[str], indices: list[int]
) -> tuple[tuple[list[int], np.ndarray, np.ndarray], int]:
    """The texts at `indices`, each encoded alone, as a group for `_merged`; and how
    many of them were truncated."""
    encoded = [fast.encode(texts[i]) for i in indices]
    group = (indices, *_end_to_end([ids for ids, _ in encoded]))
    return group, sum(cut for _, cut in encoded)


def _end_to_end(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    offsets = np.zeros(len(ids) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return np.fromiter(chain.from_iterable(ids), np.int32, int(offsets[-1])), offsets


def _merged(
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
    fast._unicode_source = (spec, rust_tokenizer)
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


def _mixed_texts() -> Iterable[str]:
    """Chinese, mixed scripts, accents, full-width forms, emoji, odd spaces; truncation."""
    yield from _MIXED
    yield "".join(_MIXED * 30)


_MIXED = (
    "向量检索与语义缓存：动态批处理、量化和多副本服务。",
    "Kafka 消费者组在成员加入或离开时重新分配分区（rebalance）。",
    "Café au lait, naïve résumé — Ünïcödé ÀÉÎÕÜ façade Ångström.",
    "Привет, мир! Ελληνικά κείμενα. 日本語のテキスト、カタカナとひらがな。",
    "한국어 문장도 처리합니다. 全角ＡＢＣ１２３！？ “quotes” ‘single’ …",
    "emoji 😀🚀 and symbols © ® ™ € £ ¥ ½ ° ± × ÷ → ← ≤ ≥ ∞",
    "zero\u200bwidth\u00a0nbsp\u3000ideographic space\u2028line\ufeffbom",
)
