"""Cutting long texts into windows of model tokens (pipeline.core.chunks), and telling
which texts the model's length cut.

Windows are cut on the tokenizer's own tokens and offsets (the Rust tokenizer's, in
characters of the text): at most N tokens each, the next starting M tokens before
the previous one ends. Cuts fall between words where the tokenizer's pre-tokenizer
says where words are (word ids), moving back at most half a window; a run without a
word boundary (a long script without spaces under SentencePiece) is cut between
tokens. Each chunk is then embedded as its own text, `prompt + text[start:end]`,
tokenized afresh as any text is: its vector is what sentence-transformers gives for
that substring.

Which texts to look at comes from the poll's ordinary tokenization (truncated at the
model's length): a text whose ids stay within the window plus the prompt and special
tokens is one row as before; only the others are tokenized whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from pipeline.core.chunks import TOO_MANY_CHUNKS, Chunking, Span
from pipeline.core.errors import ConfigError
from pipeline.core.records import STAGE_VALIDATE, BadRecord, GoodRecord

if TYPE_CHECKING:
    from pipeline.model.embedder import Embedder

T = TypeVar("T")

Tokenize = Callable[[list[str]], Sequence[Sequence[int]]]


@dataclass
class Shaped:
    """A poll's texts as rows: `spans` of the texts that are not one plain row (cut into
    chunks, or truncated), `dropped` texts (past --max-chunks: index -> the reason), the
    token ids of the chunk rows of the `cut` texts in order, and the rows truncated."""

    spans: dict[int, list[Span]] = field(default_factory=dict)
    dropped: dict[int, str] = field(default_factory=dict)
    cut: set[int] = field(default_factory=set)
    chunk_ids: Sequence[Sequence[int]] = ()
    truncated: int = 0

    @property
    def ids_unchanged(self) -> bool:
        """Whether the rows' ids are the texts' own, one row a text."""
        return not self.cut and not self.dropped

    def row_ids(self, ids: Sequence[T]) -> list[T]:
        """Each row's token ids, in order (`ids`: each text's)."""
        if self.ids_unchanged:
            return list(ids)
        chunk_ids = iter(self.chunk_ids)
        rows: list[Any] = []
        for i, one in enumerate(ids):
            if i in self.cut:
                rows += [next(chunk_ids) for _ in self.spans[i]]
            elif i not in self.dropped:
                rows.append(one)
        return rows

    def records(self, parsed: Sequence[GoodRecord | BadRecord]) -> list[GoodRecord | BadRecord]:
        """The poll's records (`parsed`: its good ones are the texts shaped, in order) as
        rows: a chunked record becomes a row a chunk, its text the chunk's; a truncated
        one says so; one past --max-chunks becomes a bad record."""
        if not self.spans and not self.dropped:
            return list(parsed)
        rows: list[GoodRecord | BadRecord] = []
        i = -1
        for record in parsed:
            if not isinstance(record, GoodRecord):
                rows.append(record)
                continue
            i += 1
            spans = self.spans.get(i)
            if i in self.dropped:
                rows.append(
                    BadRecord(record.source, STAGE_VALIDATE, TOO_MANY_CHUNKS, self.dropped[i])
                )
            elif spans is None:
                rows.append(record)
            elif i in self.cut:
                text = record.text
                rows += [
                    record._replace(text=text[s.char_start : s.char_end], span=s) for s in spans
                ]
            else:
                rows.append(record._replace(span=spans[0]))
        return rows


class Chunker:
    """Shapes a poll's texts into rows, for a tokenizer (its JSON, as the worker's) and
    `chunking` (None: no chunking, truncated texts flagged)."""

    def __init__(
        self,
        tokenizer_json: str,
        max_length: int,
        prompt: str = "",
        chunking: Chunking | None = None,
        split_special_tokens: bool = False,
    ) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_str(tokenizer_json)
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self._tokenizer.encode_special_tokens = split_special_tokens
        self.max_length = max_length
        self.prompt = prompt
        self.chunking = chunking
        # What every row carries besides its text: the prompt and the special tokens.
        self.overhead = len(self._tokenizer.encode(prompt, add_special_tokens=True).ids)
        if chunking is not None and chunking.tokens + self.overhead > max_length:
            raise ConfigError(
                f"--chunk-tokens {chunking.tokens} is past what the model takes: at most "
                f"{max_length - self.overhead} ({max_length} tokens, less {self.overhead} for "
                "the prompt and special tokens)"
            )

    def shape(
        self, texts: Sequence[str], lengths: Sequence[int], truncated: int, tokenize: Tokenize
    ) -> Shaped:
        """`lengths`: each text's ids as tokenized for the model (after the prompt, cut at
        the model's length); `truncated`: how many were cut; `tokenize`: the worker's
        tokenization of texts (the prompt added), for the chunks."""
        if self.chunking is None:
            return self._flag_truncated(texts, lengths, truncated)
        shaped = Shaped()
        window = self.chunking.tokens + self.overhead
        chunk_texts: list[str] = []
        for i, length in enumerate(lengths):
            if length <= window and length < self.max_length:
                continue
            spans = self.spans(texts[i])
            if spans is None:
                continue
            limit = self.chunking.max_chunks
            if len(spans) > limit:
                if self.chunking.overflow == "dead-letter":
                    shaped.dropped[i] = (
                        f"text is {len(spans)} chunks of --chunk-tokens {self.chunking.tokens}, "
                        f"over --max-chunks {limit}"
                    )
                    continue
                spans = [s._replace(chunk_count=limit, truncated=True) for s in spans[:limit]]
            shaped.spans[i] = spans
            shaped.cut.add(i)
            chunk_texts += [texts[i][s.char_start : s.char_end] for s in spans]
        if chunk_texts:
            shaped.chunk_ids = tokenize(chunk_texts)
            self._flag_long_chunks(shaped)
        return shaped

    def _flag_long_chunks(self, shaped: Shaped) -> None:
        """A chunk tokenized alone may take a token or two more than in its record
        (SentencePiece's word start): one that reaches the model's length is flagged."""
        ids = iter(shaped.chunk_ids)
        for i in sorted(shaped.cut):
            spans = shaped.spans[i]
            for n, span in enumerate(spans):
                if len(next(ids)) >= self.max_length:
                    spans[n] = span._replace(truncated=True)
            shaped.truncated += sum(s.truncated for s in spans)

    def spans(self, text: str) -> list[Span] | None:
        """The chunks of `text`, or None where it fits one window."""
        assert self.chunking is not None
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        windows = token_windows(encoding.word_ids, self.chunking.tokens, self.chunking.overlap)
        if windows is None:
            return None
        offsets = encoding.offsets
        count = len(windows)
        return [
            Span(n, count, offsets[start][0], offsets[end - 1][1])
            for n, (start, end) in enumerate(windows)
        ]

    def _flag_truncated(self, texts: Sequence[str], lengths: Sequence[int], cut: int) -> Shaped:
        """The texts the model's length cut: those whose ids reach it, where the
        tokenizer counted as many; else (a text that fits exactly) each one checked."""
        full = [i for i, length in enumerate(lengths) if length >= self.max_length]
        if len(full) != cut:
            prompted = [self.prompt + texts[i] for i in full]
            encodings = self._tokenizer.encode_batch(prompted, add_special_tokens=True)
            full = [i for i, e in zip(full, encodings, strict=True) if len(e.ids) > self.max_length]
        spans = {i: [Span(0, 1, 0, len(texts[i]), truncated=True)] for i in full}
        return Shaped(spans=spans, truncated=len(full))


def token_windows(
    word_ids: Sequence[int | None], window: int, overlap: int
) -> list[tuple[int, int]] | None:
    """[start, end) token windows of at most `window` tokens, each starting `overlap`
    tokens before the previous ended, cut between words where there is a boundary
    within reach; None where every token fits one window."""
    n = len(word_ids)
    if n <= window:
        return None

    def boundary(i: int) -> bool:
        before, after = word_ids[i - 1], word_ids[i]
        return before is None or after is None or before != after

    def back_to_boundary(i: int, lowest: int) -> int:
        cut = i
        while cut > lowest and not boundary(cut):
            cut -= 1
        return cut if boundary(cut) else i

    windows: list[tuple[int, int]] = []
    start = 0
    while True:
        end = min(start + window, n)
        if end < n:
            end = back_to_boundary(end, start + max(1, window // 2))
        windows.append((start, end))
        if end == n:
            return windows
        following = max(end - overlap, start + 1)
        start = back_to_boundary(following, max(start + 1, following - window // 4))


def _chunk_row(record: GoodRecord, span: Span) -> GoodRecord:
    return record._replace(text=record.text[span.char_start : span.char_end], span=span)


def chunker_for(embedder: Embedder, chunking: Chunking | None) -> Chunker:
    """The chunker of the worker's model: its tokenizer, length and document prompt."""
    return Chunker(
        embedder.tokenizer_json(),
        embedder.info.max_length,
        embedder.info.document_prompt or "",
        chunking,
        embedder.split_special_tokens,
    )


def shaped_rows(
    embedder: Embedder, chunker: Chunker, parsed: Sequence[GoodRecord | BadRecord]
) -> tuple[list[GoodRecord | BadRecord], list[Any], int]:
    """A poll's parsed records as rows (chunks), tokenized here: (records, the good
    rows' token ids, rows truncated), as the tokenizer process answers."""
    texts = [p.text for p in parsed if isinstance(p, GoodRecord)]
    tokens = embedder.tokenize(texts)
    shaped = chunker.shape(
        texts, tokens.lengths.tolist(), tokens.truncated, lambda t: embedder.tokenize(t).ids
    )
    return shaped.records(parsed), shaped.row_ids(tokens.ids), shaped.truncated
