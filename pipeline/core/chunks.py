"""Long texts as chunks (`pipeline run --chunk-tokens N --chunk-overlap M`), and what a
row says of the tokens its vector saw.

A record whose text is longer than N model tokens becomes several rows, one per
window of its text (pipeline.model.chunking cuts them): each row's `text` is its
chunk, `text[char_start:char_end]` of the record's text, with `chunk` (0-based) and
`chunk_count`. All rows of a record travel together: one batch, one segment, one
publish (consumers.batcher), so exactly once holds per record, not per chunk.

Every row of an output made by this version also says whether the model's length
cut its text (`truncated`) and how many tokens were embedded (`tokens`, the prompt
and special tokens included); outputs made before keep their columns (sinks.identity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

CHUNK = "chunk"
CHUNK_COUNT = "chunk_count"
CHAR_START = "char_start"
CHAR_END = "char_end"
TRUNCATED = "truncated"
TOKENS = "tokens"
SPAN_COLUMNS = (CHUNK, CHUNK_COUNT, CHAR_START, CHAR_END)

# What an output's rows say of their text (sinks.identity.check_output_rows): nothing
# (outputs made before), truncated and tokens, or those and the chunk's span.
PLAIN = "plain"
FLAGGED = "flagged"
CHUNKED = "chunked"

# The index gives a chunk 8 bits of a vector's id (sinks.index.shards).
MAX_CHUNKS_LIMIT = 256
OVERFLOWS = ("dead-letter", "truncate")
TOO_MANY_CHUNKS = "TooManyChunks"  # the dead-letter class past --max-chunks


class Span(NamedTuple):
    """Where a row's text lies in its record's: chunk `chunk` of `chunk_count`,
    characters [char_start, char_end). `truncated`: the model's length, or
    --max-chunks, left part of the record's text out of every row."""

    chunk: int
    chunk_count: int
    char_start: int
    char_end: int
    truncated: bool = False


def later_chunk(row: object) -> bool:
    """Whether `row` (a record as the worker holds it: good, bad or deleted) is a
    chunked record's second chunk or later: its record is counted at its first."""
    span = getattr(row, "span", None)
    return span is not None and span.chunk > 0


@dataclass(frozen=True)
class Chunking:
    """How records are cut: windows of `tokens` text tokens, `overlap` of them shared
    by neighbours; past `max_chunks` a record is dead-lettered or (`overflow`
    "truncate") keeps its first `max_chunks`."""

    tokens: int
    overlap: int = 0
    max_chunks: int = 128
    overflow: str = "dead-letter"

    def as_metadata(self) -> dict[str, str]:
        """What a segment's footer records (sinks.identity compares it)."""
        return {"chunking.tokens": str(self.tokens), "chunking.overlap": str(self.overlap)}
