"""BERT's WordPiece in a few microseconds a text: the same ids as the Rust tokenizer.

The Rust tokenizer tracks every character's offsets through normalisation and
builds a full Encoding per text: several times what Kafka and JSON cost for the
same record, and the worker's largest cost after a small model. For plain ASCII
the BERT pipeline is simple: drop control characters, lower-case (uncased models),
split into runs of letters and digits and single punctuation characters, and cut
each word into vocabulary pieces ("##" inside words). Words repeat (Zipf), so each
word's pieces are remembered: a paragraph then costs a split, a lower() and a
dictionary lookup per word; a word met for the first time is cut by the Rust
tokenizer's own WordPiece model, all of a poll's new words in one call
(docs/models.md has the measurements).

Only tokenizers whose declared pipeline is exactly that one qualify (read from
their own tokenizer.json), and only texts without "[" (special tokens such as
"[MASK]" are matched in the raw text); everything else goes to the Rust
tokenizer. At load the two are compared on a built-in sample and the fast path
is refused unless every id agrees.

Text that is not ASCII is taken where its characters were shown to be treated
as the Rust tokenizer treats them (pipeline.model.tokenize.unicode_rules).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from itertools import chain, repeat
from typing import Any

import numpy as np

from pipeline.model.tokenize import arrays
from pipeline.model.tokenize.text import CONTROL, END_ID, PLAIN_ASCII, PUNCTUATION, TEXT_END
from pipeline.model.tokenize.unicode_rules import CharacterCheck, UnicodeRules, character_check
from pipeline.model.tokenize.word_split import WordSplitter

_UNCASED_WORDS = re.compile(rf"[a-z0-9]+|{PUNCTUATION}")
_CASED_WORDS = re.compile(rf"[A-Za-z0-9]+|{PUNCTUATION}")
# The memo of word -> pieces: the common words of a corpus, a few MB at most.
MAX_REMEMBERED_WORDS = 50_000


class FastWordPiece:
    """Token ids (with [CLS] and [SEP], truncated to `max_length`) of the texts
    `handles` accepts: ASCII, and texts of the non-ASCII characters `CharacterCheck`
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
        self._memo: dict[str, list[int]] = {TEXT_END: [END_ID]}
        self._table = _PieceTable()
        self._specials: re.Pattern[str] | None = None
        self.unicode: UnicodeRules | None = None
        self._characters: CharacterCheck | None = None
        self._splitter: WordSplitter | None = None
        # What the non-ASCII rules are built from and checked against, at the first
        # non-ASCII text: English-only work never pays for them.
        # (the tokenizer's spec, the Rust tokenizer, the check on mixed texts)
        self._unicode_source: tuple[dict[str, Any], Any, Callable[[Any], bool]] | None = None
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
        once (`CharacterCheck.takes_all`), not a set a text."""
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

    def unicode_rules(self) -> UnicodeRules | None:
        """The non-ASCII rules, built and checked on first use (30 ms); None where
        the check on mixed texts found a difference (then only ASCII is taken)."""
        with self._unicode_lock:
            if self._unicode_source is not None:
                spec, rust_tokenizer, agrees_on_mixed = self._unicode_source
                self._unicode_source = None
                checks = character_check(spec, rust_tokenizer)
                if checks is not None:
                    self.unicode, self._characters = checks
                    self._splitter = self.unicode.splitter(self._word_pieces)
                    if not agrees_on_mixed(self):
                        self.unicode = self._characters = self._splitter = None
                self.forget_words()  # the samples' words are not the corpus's
        return self.unicode

    def forget_words(self) -> None:
        self._memo.clear()
        self._memo[TEXT_END] = [END_ID]

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
        clean, controls = arrays.partition(texts, arrays.has_controls)
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
        return self._encode_flat(texts, self._ascii_joined_pieces, arrays.has_controls)

    def encode_unicode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
        """`encode_ascii_flat` for texts `handles` accepts that are not ASCII: they are
        joined, normalised and split into words at once (`WordSplitter`, not a regex
        pass a text), and their words' pieces gathered from arrays. A text with a NUL
        of its own goes alone (NUL marks where a joined text ends)."""
        return self._encode_flat(texts, self._unicode_joined_pieces, arrays.has_end_mark)

    def _encode_flat(
        self,
        texts: list[str],
        joined_pieces: Callable[[list[str]], np.ndarray | None],
        goes_alone: Callable[[str], bool],
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """The texts' ids as arrays: `joined_pieces` gives the texts' pieces end to end,
        END_ID between two texts (None where one of them `goes_alone`)."""
        if not texts:
            return np.zeros(0, np.int32), np.zeros(1, np.int64), 0
        with self._table.lock:
            pieces = joined_pieces(texts)
        if pieces is not None:
            return self._arrays_at_ends(pieces, len(texts))
        together, by_themselves = arrays.partition(texts, goes_alone)
        assert by_themselves, "joined_pieces and goes_alone disagree"
        alone, truncated = arrays.encoded_alone(self, texts, by_themselves)
        groups = [alone]
        if together:
            ids, offsets, cut = self._encode_flat(
                [texts[i] for i in together], joined_pieces, goes_alone
            )
            groups.append((together, ids, offsets))
            truncated += cut
        return (*arrays.merged(len(texts), groups), truncated)

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
        joined = f" {TEXT_END} ".join(texts)
        if len(joined.encode("ascii").translate(None, PLAIN_ASCII)) != len(texts) - 1:
            return None
        if self._lowercase:
            joined = joined.lower()
        return joined.split()

    def _ascii_pieces(self, texts: list[str]) -> list[int] | None:
        """Every text's pieces, without [CLS] and [SEP], END_ID between two texts."""
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
        ends = np.flatnonzero(pieces == END_ID)
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
            end = flat.index(END_ID, start) if n < count - 1 else len(flat)
            body = flat[start:end] if end - start <= max_body else flat[start : start + max_body]
            truncated += end - start > max_body
            body.insert(0, cls)
            body.append(sep)
            out.append(body)
            start = end + 1
        return out, truncated

    def _ascii_words(self, text: str) -> list[str]:
        if CONTROL.search(text):
            text = CONTROL.sub("", text)
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
