"""The conventions the WordPiece fast path's parts share: what BERT's normaliser drops
from ASCII, its ASCII punctuation, and how texts joined into one string are marked."""

from __future__ import annotations

import re

# What BertNormalizer's clean_text removes from ASCII (tab, newline and carriage
# return are whitespace and stay, as separators).
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# BERT's punctuation in ASCII: every printable character that is not a letter or digit.
PUNCTUATION = r"[!-/:-@\[-`{-~]"
# Many texts are tokenized as one string; a NUL between them marks where a text
# ends (a text with a NUL of its own goes alone: clean_text drops it). The end
# mark's "pieces" are -1: no vocabulary id is negative.
TEXT_END = "\x00"
END_ID = -1
# Printable ASCII and the whitespace BERT splits at (where Python's split agrees):
# a joined string of these and end marks alone can be split with str.split().
PLAIN_ASCII = bytes(range(0x20, 0x7F)) + b"\t\n\r"
