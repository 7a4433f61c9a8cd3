"""The check of a chunk-mode seed (`scripts/chaos --chunk-tokens N`), on top of the
per-offset one (chaos.check), independent of the workers.

chaos.check.parquet_rows reads a chunked segment's rows of one record as one scan
row (its text a ChunkedText: the chunks' spans and texts), so the per-offset check
already counts each record once: lost, doubled, and mismatched when its chunks are
not complete or a chunk's text is not the record's text[char_start:char_end]. This
adds, per record, what exactly is wrong, and the chunker's own promises:

- complete: chunks 0..chunk_count-1, once each, one chunk_count (`incomplete`);
- in one segment: an offset's rows never in two segments (`split`: its chunks
  shared out between segments; chunks twice are `doubled`, as any offset twice);
- every row of a chunked run has the chunk columns (`unchunked`);
- each chunk's text is the record's text[char_start:char_end] (`text`); the spans
  in order, overlapping when M > 0, not when M = 0, and between and around them
  nothing but whitespace left out, the last one reaching the end (`spans`);
- the windows: no chunk over N model tokens (`oversize`), a record over N tokens
  cut (`uncut`), one within N tokens one chunk (`overcut`), and, where N leaves
  room below the model's length, no row flagged `truncated`.

Token counts are the model's tokenizer's (chaos.long_texts); without one, the three
window checks are skipped.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from chaos.check import ChunkedText
from chaos.common import ranges
from chaos.long_texts import LongTexts
from chaos.records import value_text

Place = tuple[int, int]
DESCRIBED = 8  # problems described one by one; past it, only their offsets
# Tokens a chunk's row may take on top of its N (special tokens, a prompt) before the
# model's length could flag it truncated.
_HEADROOM = 8


@dataclass
class ChunkVerdict:
    tokens: int  # --chunk-tokens N
    overlap: int  # --chunk-overlap M
    rows: int = 0  # chunk rows of the seed's records
    records: int = 0  # records with rows
    multi: int = 0  # records in two or more chunks
    long_published: int = 0  # good records over N tokens (the topic's)
    max_chunk_count: int = 0
    truncated: int = 0  # rows flagged truncated
    truncation_expected: bool = True  # False: N leaves room below the model's length
    incomplete: list[Place] = field(default_factory=list)
    split: list[Place] = field(default_factory=list)
    unchunked: list[Place] = field(default_factory=list)
    text: list[Place] = field(default_factory=list)
    spans: list[Place] = field(default_factory=list)
    oversize: list[Place] = field(default_factory=list)
    uncut: list[Place] = field(default_factory=list)
    overcut: list[Place] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    LISTS = ("incomplete", "split", "unchunked", "text", "spans", "oversize", "uncut", "overcut")

    def problems(self) -> list[str]:
        found = []
        for name in self.LISTS:
            keys = sorted(set(getattr(self, name)))
            if keys:
                found.append(f"chunks {name} {len(keys)}: {ranges(keys)}")
        if self.truncated and not self.truncation_expected:
            found.append(
                f"chunks truncated {self.truncated}: rows flagged truncated, though "
                f"--chunk-tokens {self.tokens} leaves room below the model's length"
            )
        if found:
            found += [f"  {d}" for d in self.details[:DESCRIBED]]
        return found

    def summary(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "records": self.records,
            "long_published": self.long_published,
            "multi": self.multi,
            "max_chunk_count": self.max_chunk_count,
            "truncated": self.truncated,
            **{name: len(set(getattr(self, name))) for name in self.LISTS},
        }


def _short(text: str, width: int = 40) -> str:
    return repr(text if len(text) <= width else text[: width - 1] + "…")


def check_chunks(
    real: dict[Place, bytes | None],
    rows: list[tuple[int, int, str]],
    corpus: LongTexts | None,
    tokens: int,
    overlap: int,
    model_length: int | None = None,
) -> ChunkVerdict:
    """The chunks of every record with rows, against the records the topic holds."""
    verdict = ChunkVerdict(tokens, overlap)
    if model_length is not None:
        verdict.truncation_expected = tokens + _HEADROOM > model_length
    by_place: dict[Place, list[str]] = {}
    for partition, offset, text in rows:
        by_place.setdefault((partition, offset), []).append(text)
    texts = {place: value_text(value) for place, value in real.items()}
    verdict.records = len(by_place)
    windows: list[tuple[Place, int, str]] = []  # (place, chunk, text) to count tokens of
    for place, held in sorted(by_place.items()):
        chunked = [t for t in held if isinstance(t, ChunkedText)]
        if len(chunked) != len(held):
            verdict.unchunked.append(place)
        if len(chunked) > 1:
            numbers = [n for t in chunked for n in t.chunks]
            if len(numbers) == len(set(numbers)):
                verdict.split.append(place)
                verdict.details.append(
                    f"{place}: chunks {[t.chunks for t in chunked]} in {len(chunked)} segments"
                )
        record = texts.get(place)
        for text in chunked:
            verdict.rows += len(text.spans)
            verdict.truncated += sum(1 for span in text.spans if span[5])
            counts = {span[1] for span in text.spans}
            verdict.max_chunk_count = max(verdict.max_chunk_count, *counts)
            if not text.complete:
                verdict.incomplete.append(place)
                verdict.details.append(
                    f"{place}: chunks {text.chunks}, chunk_count {sorted(counts)}"
                )
            if record is not None:  # an incomplete record: its chunks' texts alone
                _check_spans(verdict, place, text, record, whole=text.complete)
            windows += [(place, span[0], span[4]) for span in text.spans]
        if len(chunked) == 1 and chunked[0].complete and len(chunked[0].spans) > 1:
            verdict.multi += 1
    if corpus is not None and corpus.has_tokenizer:
        _check_windows(verdict, by_place, texts, windows, corpus)
    return verdict


def _check_spans(
    verdict: ChunkVerdict, place: Place, text: ChunkedText, record: str, whole: bool
) -> None:
    """Each chunk's text the record's text[char_start:char_end]; and (`whole`: its
    chunks are complete) the spans in order, with the overlap asked for, nothing but
    whitespace outside them."""
    previous: tuple[int, int, int, int, str, bool] | None = None
    wrong: list[str] = []
    for span in text.spans:
        chunk, _, start, end, chunk_text, _ = span
        if not 0 <= start < end <= len(record):
            wrong.append(f"chunk {chunk} [{start}:{end}] outside the text of {len(record)}")
        elif record[start:end] != chunk_text:
            verdict.text.append(place)
            verdict.details.append(
                f"{place} chunk {chunk} [{start}:{end}]: row {_short(chunk_text)}, "
                f"record {_short(record[start:end])}"
            )
        if not whole:
            continue
        low = 0 if previous is None else previous[3]
        if previous is not None and (start <= previous[2] or end <= previous[3]):
            wrong.append(f"chunk {chunk} [{start}:{end}] not after [{previous[2]}:{low}]")
        elif previous is not None and verdict.overlap > 0 and start >= low:
            wrong.append(f"chunk {chunk} [{start}:{end}] does not overlap [{previous[2]}:{low}]")
        elif previous is not None and verdict.overlap == 0 and start < low:
            wrong.append(f"chunk {chunk} [{start}:{end}] overlaps [{previous[2]}:{low}]")
        if start > low and record[low:start].strip():
            wrong.append(f"text[{low}:{start}] {_short(record[low:start])} in no chunk")
        previous = span
    if whole and previous is not None and record[previous[3] :].strip():
        wrong.append(f"text[{previous[3]}:] {_short(record[previous[3] :])} after the last chunk")
    if wrong:
        verdict.spans.append(place)
        verdict.details.append(f"{place}: {'; '.join(wrong[:3])}")


def _check_windows(
    verdict: ChunkVerdict,
    by_place: dict[Place, list[str]],
    texts: dict[Place, str | None],
    windows: list[tuple[Place, int, str]],
    corpus: LongTexts,
) -> None:
    """No chunk over N tokens; a record over N tokens cut, one within N tokens not."""
    n = verdict.tokens
    counts = corpus.tokens([text for *_, text in windows])
    for (place, chunk, text), count in zip(windows, counts, strict=True):
        if count > n:
            verdict.oversize.append(place)
            verdict.details.append(f"{place} chunk {chunk}: {count} tokens > {n}: {_short(text)}")
    good = {place: text for place, text in texts.items() if text is not None}
    sizes = dict(zip(good, corpus.tokens(list(good.values())), strict=True))
    verdict.long_published = sum(1 for size in sizes.values() if size > n)
    chunk_counts: Counter[Place] = Counter()
    for place, held in by_place.items():
        if len(held) == 1 and isinstance(held[0], ChunkedText) and held[0].complete:
            chunk_counts[place] = len(held[0].spans)
    for place, count in chunk_counts.items():
        size = sizes.get(place)
        if size is None:
            continue
        if size > n and count == 1:
            verdict.uncut.append(place)
            verdict.details.append(f"{place}: {size} tokens > {n} in one chunk")
        elif size <= n and count > 1:
            verdict.overcut.append(place)
            verdict.details.append(f"{place}: {size} tokens <= {n} in {count} chunks")
