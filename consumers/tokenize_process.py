"""Tokenizing in a child process, one poll ahead of the poll loop.

With a fast model (a GPU, a small one) the poll loop is the worker's ceiling:
everything it does holds the GIL, and tokenizing was a quarter of it (with it
free, the path around the model ran 1.3x faster: scripts/overhead.py). Here a
child process tokenizes one poll's texts while the poll loop decodes the next
poll from Kafka, on another core. Ids come back as one int32 array and its
offsets; each text's ids are a view of it, not a Python list (making those lists
cost as much as half the tokenizing).

The child runs pipeline.wordpiece's fast path, rebuilt from the worker's own
tokenizer (and checked against it at start, as in-process); the texts that path
leaves are tokenized there too, with that Rust tokenizer (truncation included),
not in the poll loop (in a Chinese corpus 4% of the texts took a quarter of the
loop's CPU). Where the fast path does not apply the child says so and the worker
tokenizes everything itself.

When a poll's records join the batcher is the poll loop's business
(consumers.worker): in poll order, before anything else touches the batcher.
The child dies with the worker (PR_SET_PDEATHSIG on Linux) and leaves signals sent
to the whole process group to the worker, which drains with its help; a child that
dies or stops answering ends the worker with one line, nothing committed past what
was written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from itertools import pairwise
from multiprocessing.connection import Connection
from typing import Any

from pipeline.errors import PipelineError

log = logging.getLogger(__name__)

# Start-up: an interpreter, tokenizers and the fast path's check at load.
START_TIMEOUT_S = 60.0
# A poll's texts take milliseconds; this only bounds a child that hangs.
ANSWER_TIMEOUT_S = 120.0
_TICK_S = 0.05


class TokenizerProcess:
    """A child process that tokenizes lists of texts, one request at a time."""

    def __init__(self, tokenizer_json: str, max_length: int) -> None:
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
        self._conn.send_bytes(tokenizer_json.encode())

    @classmethod
    def start(cls, tokenizer_json: str, max_length: int) -> TokenizerProcess | None:
        """A ready child; None where the fast path does not apply to this tokenizer."""
        process = cls(tokenizer_json, max_length)
        return process if process.ready() else None

    def ready(self) -> bool:
        """Waits (bounded) for the child to have built its fast path: False, and the
        child ended, where it does not apply to this tokenizer. The worker asks at its
        first large poll, so that the child starts while the group is joined."""
        if self._ready is None:
            try:
                kind, detail = self._answer(START_TIMEOUT_S)
            except PipelineError:
                self.close()
                raise
            self._ready = kind == "ready"
            if self._ready:
                log.info("tokenizer process: on (a poll ahead of the poll loop)")
            else:
                self.close()
                log.info("tokenizer process: not used (%s)", detail)
        return self._ready

    def submit(self, texts: list[str]) -> None:
        assert self._ready and not self._waiting, "one request at a time, once ready"
        try:
            self._conn.send_bytes(pickle.dumps(texts, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as exc:
            raise self._gone() from exc
        self._waiting = True

    def result(self) -> tuple[list[Any], int, list[int]]:
        """(ids, truncated, others) of the submitted texts, as `wordpiece.encode_taken`
        gives them, each text's ids a view of one int32 array; `others` is empty (the
        child tokenizes them too)."""
        assert self._waiting, "nothing was submitted"
        kind, detail = self._answer(ANSWER_TIMEOUT_S)
        self._waiting = False
        if kind != "ids":
            raise PipelineError(f"the tokenizer process answered {kind!r}: {detail}")
        flat, offsets, truncated, others = detail
        bounds = offsets.tolist()
        ids = [flat[start:end] for start, end in pairwise(bounds)]
        return ids, truncated, others

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
            raise PipelineError(f"the tokenizer process failed: {message[1]}")
        return message

    def _gone(self) -> PipelineError:
        code = self._child.poll()
        how = "stopped answering" if code is None else f"exited with code {code}"
        return PipelineError(
            f"the tokenizer process {how}; restart the worker "
            "(or run it with --tokenizer-process off)"
        )


def main() -> None:
    """The child: argv = SOCKET_FD MAX_LENGTH PARENT_PID."""
    from pipeline.host import die_with_parent

    fd, max_length, parent = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    # Signals to the whole group (Ctrl-C, a service manager stopping the unit) are the
    # worker's to act on: it drains, with this child's help, then closes it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:
        return  # the worker died before the death signal was armed
    conn = Connection(fd)
    try:
        _serve(conn, max_length)
    except (EOFError, OSError):
        return  # the worker closed its end, or is gone
    except Exception as exc:  # one line for the worker to report, never a traceback
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}")))
        sys.exit(1)


def _serve(conn: Connection, max_length: int) -> None:
    from tokenizers import Tokenizer

    from pipeline import wordpiece

    rust_tokenizer = Tokenizer.from_str(conn.recv_bytes().decode())
    fast = wordpiece.for_tokenizer(rust_tokenizer, max_length)
    if fast is None:
        conn.send_bytes(pickle.dumps(("refused", "the tokenizer has no fast path")))
        return
    conn.send_bytes(pickle.dumps(("ready", None)))
    while True:
        texts: list[str] = pickle.loads(conn.recv_bytes())
        answer = ("ids", wordpiece.encode_taken_flat(fast, texts, rust_tokenizer))
        conn.send_bytes(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))
