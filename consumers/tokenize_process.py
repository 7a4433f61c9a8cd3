"""Parsing and tokenizing in a child process, one poll ahead of the poll loop.

With a fast model (a GPU, a small one) the poll loop is the worker's ceiling:
everything it does holds the GIL, and tokenizing was a quarter of it (with it
free, the path around the model ran 1.3x faster: scripts/overhead.py), parsing the
records' JSON a seventh. Here a child process parses one poll's record values
(pipeline.core.records, the worker's own parser) and tokenizes their texts while the
poll loop decodes the next poll from Kafka, on another core. The parses come back
as columns (texts, ids, metadata; the bad records' reasons); the token ids as one
int32 array and its offsets, each text's ids a view of it, not a Python list
(making those lists cost as much as half the tokenizing).

The child runs pipeline.model.tokenize.wordpiece's fast path where the tokenizer is BERT's
WordPiece (rebuilt from the worker's own tokenizer and checked against it at
start, its tables built before the child says it is ready), and the Rust
tokenizer for the texts that path leaves and for every other tokenizer
(truncation included): none of it in the poll loop.

When a poll's records join the batcher is the poll loop's business
(consumers.worker): in poll order, before anything else touches the batcher.
The child dies with the worker (PR_SET_PDEATHSIG on Linux) and leaves signals sent
to the whole process group to the worker, which drains with its help; a child that
dies or stops answering ends the worker with one line, nothing committed past what
was written. An exception in the child is a bug (parsing turns every bad value into
a bad record): it ends the worker with the child's traceback (`TokenizerChildError`).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from pipeline.core.chunks import Chunking
from pipeline.core.errors import PipelineError
from pipeline.core.host import how_child_ended
from pipeline.core.records import (
    BadRecord,
    GoodRecord,
    RecordParser,
    Source,
    SourceRecord,
    good_records,
)

log = logging.getLogger(__name__)

# Start-up: an interpreter, tokenizers and the fast path's check at load.
START_TIMEOUT_S = 60.0
# A poll's texts take milliseconds; this only bounds a child that hangs.
ANSWER_TIMEOUT_S = 120.0
_TICK_S = 0.05


class TokenizerChildError(RuntimeError):
    """The child raised, or answered out of turn: a bug, never an input's fault. The
    message carries the child's traceback; the CLI prints it and asks for a report."""


class TokenizerProcess:
    """A child process that parses record values and tokenizes the good ones' texts
    (after `prompt`), one poll at a time, as `parser` and the tokenizer say."""

    def __init__(
        self,
        tokenizer_json: str,
        max_length: int,
        parser: RecordParser | None = None,
        prompt: str = "",
        fast_path: bool = True,
        split_special_tokens: bool = False,
        chunking: Chunking | None = None,
    ) -> None:
        """`chunking`: long texts cut into chunks (pipeline.model.chunking); the answers
        then hold a row a chunk. `fast_path` False: the Rust tokenizer for every text
        (PIPELINE_TOKENIZER=rust).
        `split_special_tokens`: the tokenizer's `encode_special_tokens`, which its JSON
        does not carry (a special token's text in a record is then plain text)."""
        parent_end, child_end = socket.socketpair()
        self._child = subprocess.Popen(
            [sys.executable, "-c", "from consumers.tokenize_process import main; main()",
             str(child_end.fileno()), str(max_length), str(os.getpid())],
            pass_fds=(child_end.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        child_end.close()
        self._conn = Connection(parent_end.detach())
        self._waiting = False
        self._ready: bool | None = None  # known once the child's first answer is read
        setup = (
            tokenizer_json,
            parser or RecordParser(),
            prompt,
            fast_path,
            split_special_tokens,
            chunking,
        )
        self._conn.send_bytes(pickle.dumps(setup, protocol=pickle.HIGHEST_PROTOCOL))

    @classmethod
    def start(
        cls,
        tokenizer_json: str,
        max_length: int,
        parser: RecordParser | None = None,
        prompt: str = "",
        fast_path: bool = True,
        split_special_tokens: bool = False,
        chunking: Chunking | None = None,
    ) -> TokenizerProcess:
        """A ready child (waited for)."""
        process = cls(
            tokenizer_json, max_length, parser, prompt, fast_path, split_special_tokens, chunking
        )
        process.ready()
        return process

    def ready(self) -> bool:
        """Waits (bounded) for the child to have built its tokenizers: True, or the
        child's failure raised (and the child ended). The worker asks at its first
        large poll, so that the child starts while the group is joined."""
        if self._ready is None:
            try:
                kind, detail = self._answer(START_TIMEOUT_S)
                if kind != "ready":
                    raise TokenizerChildError(f"the tokenizer process answered {kind!r} at start")
            except (PipelineError, TokenizerChildError):
                self.close()
                raise
            self._ready = True
            log.info("tokenizer process: on, %s (a poll ahead of the poll loop)", detail)
        return self._ready

    def submit_values(self, values: list[bytes | None]) -> None:
        """A poll's record values to parse, then tokenize the good ones' texts after
        the prompt: `parsed_result` answers."""
        assert self._ready and not self._waiting, "one request at a time, once ready"
        try:
            self._conn.send_bytes(pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as exc:
            raise self._gone() from exc
        self._waiting = True

    def parsed_result(
        self, sources: list[Source]
    ) -> tuple[list[GoodRecord | BadRecord], list[Any], int]:
        """The submitted values' records (`sources`, in the order their values were
        submitted) as `RecordParser.parse` makes them, shaped into rows (a chunked
        record: a row a chunk; pipeline.model.chunking), the good rows' token ids (each
        a memoryview of one int32 array) and how many of those were truncated."""
        assert self._waiting, "nothing was submitted"
        kind, detail = self._answer(ANSWER_TIMEOUT_S)
        self._waiting = False
        if kind != "parsed":
            raise TokenizerChildError(f"the tokenizer process answered {kind!r} to a poll")
        (flat, offsets, truncated, _), texts, record_ids, metadatas, bad, shaped = detail
        ids = _views(flat, offsets)
        if not bad:
            records = good_records(sources, texts, record_ids, metadatas)
            return shaped.records(records), ids, truncated
        reasons = {index: reason for index, *reason in bad}
        good_sources = [s for i, s in enumerate(sources) if i not in reasons]
        good = iter(good_records(good_sources, texts, record_ids, metadatas))
        parsed: list[GoodRecord | BadRecord] = [
            BadRecord(s, *reasons[i]) if i in reasons else next(good) for i, s in enumerate(sources)
        ]
        return shaped.records(parsed), ids, truncated

    def close(self) -> None:
        """Ends the child (it exits when its end of the connection closes)."""
        self._conn.close()
        try:
            self._child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()

    def _answer(self, timeout_s: float) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._conn.poll(_TICK_S):
                    message: tuple[str, Any] = pickle.loads(self._conn.recv_bytes())
                    break
            except (EOFError, OSError) as exc:
                raise self._gone() from exc
            if self._child.poll() is not None:
                raise self._gone()
            if time.monotonic() > deadline:
                raise PipelineError(
                    f"the tokenizer process did not answer within {timeout_s:.0f}s; "
                    "restart the worker (or run it with --tokenizer-process off)"
                )
        if message[0] == "error":
            raise TokenizerChildError(f"the tokenizer process failed:\n{message[1]}")
        return message

    def _gone(self) -> PipelineError:
        return PipelineError(
            f"the tokenizer process {how_child_ended(self._child)}; restart the worker "
            "(or run it with --tokenizer-process off)"
        )


class TokenizerPool:
    """Several tokenizer processes, each taking a contiguous slice of every poll:
    where one child is the ceiling (many CPUs beside a GPU, a tokenizer without the
    fast path). The same calls as one TokenizerProcess."""

    def __init__(self, count: int, *args: Any, **kwargs: Any) -> None:
        self._children = [TokenizerProcess(*args, **kwargs) for _ in range(max(1, count))]
        self._slices: list[tuple[TokenizerProcess, int, int]] = []

    def __len__(self) -> int:
        return len(self._children)

    def ready(self) -> bool:
        return all([child.ready() for child in self._children])  # each waited for

    def submit_values(self, values: list[bytes | None]) -> None:
        share = -(-len(values) // len(self._children)) or 1
        self._slices = []
        for child, start in zip(self._children, range(0, len(values), share), strict=False):
            end = min(start + share, len(values))
            child.submit_values(values[start:end])
            self._slices.append((child, start, end))

    def parsed_result(
        self, sources: list[Source]
    ) -> tuple[list[GoodRecord | BadRecord], list[Any], int]:
        records: list[GoodRecord | BadRecord] = []
        ids: list[Any] = []
        truncated = 0
        for child, start, end in self._slices:
            part_records, part_ids, part_truncated = child.parsed_result(sources[start:end])
            records += part_records
            ids += part_ids
            truncated += part_truncated
        self._slices = []
        return records, ids, truncated

    def close(self) -> None:
        for child in self._children:
            child.close()


def _views(flat: Any, offsets: Any) -> list[memoryview]:
    """Each text's ids, a memoryview of `flat`, made by C-level maps: a numpy view a
    text cost far more of the poll loop's GIL."""
    bounds = offsets.tolist()
    ids = memoryview(np.ascontiguousarray(flat, dtype=np.int32))  # one format for every poll
    return list(map(ids.__getitem__, map(slice, bounds, bounds[1:])))


def main() -> None:
    """The child: argv = SOCKET_FD MAX_LENGTH PARENT_PID."""
    from pipeline.core.host import die_with_parent, serve_as_child

    fd, max_length, parent = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:
        return  # the worker died before the death signal was armed
    serve_as_child(fd, lambda conn: _serve(conn, max_length), "error")


def _serve(conn: Connection, max_length: int) -> None:
    from tokenizers import Tokenizer

    from pipeline.model.chunking import Chunker
    from pipeline.model.tokenize import batches, fast_path

    setup = pickle.loads(conn.recv_bytes())
    tokenizer_json, parser, prompt, use_fast_path, split, chunking = setup
    rust_tokenizer = Tokenizer.from_str(tokenizer_json)
    rust_tokenizer.encode_special_tokens = split
    fast = fast_path.for_tokenizer(rust_tokenizer, max_length) if use_fast_path else None
    chunker = Chunker(tokenizer_json, max_length, prompt, chunking, split)

    def tokenize(texts: list[str]) -> Any:
        prompted = [prompt + text for text in texts] if prompt else texts
        if fast is not None:
            return batches.encode_taken_flat(fast, prompted, rust_tokenizer)
        return batches.encode_rust_flat(rust_tokenizer, prompted)

    if fast is not None:
        fast.unicode_rules()  # built now, not at the first non-ASCII poll
    kind = "the fast WordPiece path" if fast is not None else "the Rust tokenizer"
    conn.send_bytes(pickle.dumps(("ready", kind)))
    while True:
        values: list[bytes | None] = pickle.loads(conn.recv_bytes())
        texts, record_ids, metadatas, bad = _parsed(parser, values)
        flat, offsets, truncated, others = tokenize(texts)
        shaped = chunker.shape(
            texts, np.diff(offsets).tolist(), truncated, lambda t: _views(*tokenize(t)[:2])
        )
        if not shaped.ids_unchanged:
            flat, offsets = _joined(shaped.row_ids(_views(flat, offsets)))
        shaped.chunk_ids = ()  # in `flat` now
        tokens = (flat, offsets, shaped.truncated, others)
        answer = ("parsed", (tokens, texts, record_ids, metadatas, bad, shaped))
        conn.send_bytes(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))


def _joined(rows: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Rows' ids end to end (int32), and where each starts (and the last ends)."""
    lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    parts = [np.frombuffer(row, np.int32) for row in rows]
    flat = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return flat, offsets


def _parsed(
    parser: RecordParser, values: list[bytes | None]
) -> tuple[list[str], list[str | None], list[str | None], list[tuple[int, str, str, str]]]:
    """Values parsed as the worker would (pipeline.core.records): the good ones' fields as
    columns, the bad ones' (index, stage, class, message)."""
    texts: list[str] = []
    record_ids: list[str | None] = []
    metadatas: list[str | None] = []
    bad: list[tuple[int, str, str, str]] = []
    for index, value in enumerate(values):
        parsed = parser.parse(SourceRecord("", -1, -1, -1, None, value))
        if isinstance(parsed, GoodRecord):
            texts.append(parsed.text)
            record_ids.append(parsed.record_id)
            metadatas.append(parsed.metadata)
        else:
            bad.append((index, parsed.stage, parsed.error_class, parsed.message))
    return texts, record_ids, metadatas, bad
