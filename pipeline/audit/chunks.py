"""The chunks of a chunked output's records (`pipeline run --chunk-tokens N`): pure.

A record of N chunks is N rows of one segment, (offset, chunk) for chunk 0..N-1,
each once, all with chunk_count N (pipeline.core.chunks). The offset accounting
counts a record once, whatever its rows; this check says which records' chunks
are not complete: a chunk missing or twice, one past its chunk_count, or rows
that disagree on the count. A record whose rows lie in two segments is incomplete
in each of them (and, as an offset in two segments, doubled).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

# Problems described one by one per partition; past this, only their offsets are listed.
DESCRIBED = 20


@dataclass(frozen=True)
class ChunkProblem:
    """One record whose chunks are not complete, and what is wrong with them."""

    offset: int
    problem: str

    def __str__(self) -> str:
        return f"offset {self.offset}: {self.problem}"


def bad_chunk_offsets(offsets: np.ndarray, chunks: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The distinct offsets (sorted) whose rows are not exactly chunks 0..count-1 once each
    with one count. The three arrays: one value per row of one segment and partition
    (a null chunk or count read as -1)."""
    if offsets.size == 0:
        return np.empty(0, dtype=np.int64)
    order = np.lexsort((chunks, offsets))
    offsets, chunks, counts = offsets[order], chunks[order], counts[order]
    starts = np.flatnonzero(np.concatenate(([True], offsets[1:] != offsets[:-1])))
    sizes = np.diff(np.concatenate((starts, [offsets.size])))
    group = np.repeat(np.arange(starts.size), sizes)
    position = np.arange(offsets.size) - starts[group]
    # Sorted by chunk within an offset, a complete record reads 0, 1, ..., n-1 with
    # every count n: any other row marks its record.
    wrong = (chunks != position) | (counts != sizes[group])
    return np.unique(offsets[wrong]).astype(np.int64)


def describe_chunks(chunk_values: Iterable[int], count_values: Iterable[int]) -> str:
    """What is wrong with one record's chunks (its rows' chunk and chunk_count values)."""
    chunks, counts = [int(c) for c in chunk_values], sorted({int(c) for c in count_values})
    problems = []
    if any(c < 0 for c in chunks) or any(c <= 0 for c in counts):
        problems.append("chunk or chunk_count null or negative")
    seen: dict[int, int] = {}
    for chunk in chunks:
        seen[chunk] = seen.get(chunk, 0) + 1
    twice = sorted(c for c, n in seen.items() if n > 1)
    if twice:
        problems.append(f"chunk {_list(twice)} more than once")
    if len(counts) > 1:  # which count is right is unknown: what is missing, too
        problems.insert(0, "chunk_count " + " and ".join(map(str, counts)))
        return "; ".join(problems)
    expected = max(counts, default=0)
    past = sorted(c for c in seen if c >= expected)
    if past and expected > 0:
        problems.append(f"chunk {_list(past)} past chunk_count {expected}")
    missing = [c for c in range(expected) if c not in seen]
    if missing:
        problems.append(f"chunk {_list(missing)} of {expected} missing")
    return "; ".join(problems) or "chunks out of order"


def chunk_problems(
    offsets: np.ndarray, chunks: np.ndarray, counts: np.ndarray, limit: int = DESCRIBED
) -> tuple[np.ndarray, list[ChunkProblem]]:
    """The offsets whose chunks are not complete (sorted, distinct), and the first
    `limit` of them described."""
    bad = bad_chunk_offsets(offsets, chunks, counts)
    described = []
    for offset in bad[:limit]:
        rows = offsets == offset
        described.append(ChunkProblem(int(offset), describe_chunks(chunks[rows], counts[rows])))
    return bad, described


def _list(values: list[int], limit: int = 6) -> str:
    shown = ",".join(map(str, values[:limit]))
    return shown + (f" (+{len(values) - limit} more)" if len(values) > limit else "")
