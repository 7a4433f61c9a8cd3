"""BertPreTokenizer's split of a normalised string into words, in numpy.

The split regex (`[alone]|[^\\s alone]+`: punctuation and CJK ideographs are words
alone, runs of anything else but whitespace are words) costs about 150 ns a match
in `re`, one match a Chinese character. Here every character's kind comes from a
table by code point, the word edges from array comparisons, and a character that
is a word alone goes straight to its piece id: only runs become Python strings.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

_UNKNOWN, _SPACE, _ALONE, _RUN = 0, 1, 2, 3
_WHITESPACE = re.compile(r"\s")


def code_points(text: str) -> np.ndarray:
    """The text's code points (uint32), one a character: a lone surrogate (JSON
    allows one) is its own code point, as in a regex, not an encoding error."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)


@dataclass(frozen=True)
class Words:
    """A string's words in order: each either a character alone (its piece id
    known) or a run (its pieces to look up)."""

    runs: list[str]
    alone_ids: np.ndarray  # int32, the piece of each word alone, in order
    is_alone: np.ndarray  # bool a word, in order

    def pieces(self, run_pieces: np.ndarray, run_lengths: np.ndarray) -> np.ndarray:
        """Every word's pieces end to end (int32), from the runs' pieces end to end
        and how many each run has."""
        counts = np.ones(len(self.is_alone), np.int64)
        counts[~self.is_alone] = run_lengths
        starts = np.cumsum(counts) - counts
        out = np.empty(int(counts.sum()), np.int32)
        out[starts[self.is_alone]] = self.alone_ids
        # Run k's pieces move from where they sit in `run_pieces` to its word's start.
        run_starts = np.cumsum(run_lengths) - run_lengths
        shift = np.repeat(starts[~self.is_alone] - run_starts, run_lengths)
        out[shift + np.arange(len(run_pieces))] = run_pieces
        return out


class WordSplitter:
    """Splits strings as `alone` and whitespace say; learns a character's kind (and,
    for one alone, its piece from `piece_of`) the first time it meets it."""

    def __init__(
        self, alone: re.Pattern[str], piece_of: Callable[[str], list[int]], marks: dict[str, int]
    ) -> None:
        """`marks` are characters that are words alone with a fixed id (an end mark)."""
        self._alone = alone
        self._piece_of = piece_of
        self._lock = threading.Lock()  # learning writes the tables another split reads
        self._kinds = np.zeros(0x110000, np.uint8)  # _UNKNOWN; untouched pages cost no memory
        self._ids = np.zeros(0x110000, np.int32)
        for char, piece in marks.items():
            self._ids[ord(char)] = piece
            self._kinds[ord(char)] = _ALONE

    def split(self, text: str) -> Words:
        codes = code_points(text)
        kinds = self._kinds[codes]
        if not kinds.all():
            self._learn(np.unique(codes[kinds == _UNKNOWN]))
            kinds = self._kinds[codes]
        run = kinds == _RUN
        # The runs as strings by one str.split of the text with every other character
        # a space (a run holds no whitespace), not a slice a run: a fifth of the cost.
        spaced = np.where(run, codes, np.uint32(32))
        runs = spaced.tobytes().decode("utf-32-le", "surrogatepass").split()
        run_starts = run.copy()
        run_starts[1:] &= ~run[:-1]
        alone = kinds == _ALONE
        firsts = alone | run_starts
        at = np.flatnonzero(firsts)
        is_alone = alone[at]
        return Words(runs, self._ids[codes[at[is_alone]]], is_alone)

    def _learn(self, codes: np.ndarray) -> None:
        with self._lock:
            for code in codes.tolist():
                char = chr(code)
                if _WHITESPACE.fullmatch(char):
                    kind = _SPACE
                elif self._alone.fullmatch(char):
                    (self._ids[code],) = self._piece_of(char)  # one piece: a word of one character
                    kind = _ALONE
                else:
                    kind = _RUN
                self._kinds[code] = kind  # after its id: a split without the lock reads both
