"""OpenVINO replicas as processes: each child compiles the cached model with one
stream of its own threads and runs one infer request, one pass at a time.

Why processes: in one process, replicas either take turns on one request of one
stream of all their threads, which stalls at every barrier whenever anything else
in the worker (polling, writing, the tokenizer process) takes one of its cores, or
run a request each, which meeting a new pass shape at once specialise it
concurrently in one runtime's thread pools and twice never finished here (as
ultralytics' CI found on AMD EPYC, their issue 25923). A process each has neither:
its runtime meets one pass at a time, and a core taken from it stalls it alone
(docs/performance.md, int8 on OpenVINO: the worker end to end ran 10 % faster).

A pass goes to any idle child as int64 ids and mask; the child writes its hidden
states into memory it shares with the worker (a file of its own, memfd on Linux,
grown to the largest pass it has run), and the caller pools them in place, the child
held until it has (sent over the socket they were half of the worker's CPU around the
passes: docs/performance.md, around the passes). A child that
dies or does not answer within the pass timeout ends the worker with one line
(nothing of its batch is written or committed); the child ends with the worker
(its connection closes; it also checks that its parent is alive every second: not
PR_SET_PDEATHSIG, which fires when the thread that started the child ends, here
the model-loading thread) and leaves signals sent to the whole group to the worker. An
error OpenVINO raises in a pass (a kernel the CPU lacks) is a ModelError as in
process; any other exception in the child is a bug and comes back with its
traceback.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import pickle
import queue
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.errors import ModelError
from pipeline.core.host import how_child_ended, serve_as_child

log = logging.getLogger(__name__)

# An interpreter, OpenVINO's import and the model's compilation (seconds for a large one).
START_TIMEOUT_S = 120.0
_CLOSE_TIMEOUT_S = 5.0
# The shared states' file starts this large and doubles as a pass needs.
_MIN_SHARED_BYTES = 1 << 20
_PARENT_CHECK_S = 1.0


class EngineChildError(RuntimeError):
    """The engine process raised something other than OpenVINO's own error: a bug,
    with the child's traceback in the message."""


def _shared_file(name: str) -> int:
    """A file descriptor of memory to share with a child: memfd where there is one
    (Linux), else an unlinked temporary file."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name)
    return os.dup(tempfile.TemporaryFile(prefix=name).fileno())


class SharedStates:
    """The hidden states of a child's last pass, in a file both processes map. The
    child grows it (`fit`); the worker maps it again when it has grown (`view`)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map: mmap.mmap | None = None

    @property
    def size(self) -> int:
        return 0 if self._map is None else len(self._map)

    def fit(self, shape: tuple[int, ...]) -> np.ndarray:
        """The child's side: room for float32 states of `shape`, as an array."""
        need = int(np.prod(shape)) * 4
        if need > self.size:
            size = max(_MIN_SHARED_BYTES, 1 << (need - 1).bit_length())
            os.ftruncate(self.fd, size)
            self._remap(size)
        return self.view(shape, self.size)

    def view(self, shape: tuple[int, ...], size: int) -> np.ndarray:
        """float32 states of `shape` at the start of a file `size` bytes long."""
        if size > self.size:
            self._remap(size)
        assert self._map is not None
        return np.ndarray(shape, dtype=np.float32, buffer=self._map)

    def _remap(self, size: int) -> None:
        # The old map is not closed: an array of it may still be in use; it goes with
        # its last reference.
        self._map = mmap.mmap(self.fd, size)

    def close(self) -> None:
        """Closes the descriptor, once (the number may be another file's afterwards);
        the maps stay valid until their last array goes."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


class _Child:
    """One engine process, its end of the connection and the states it shares."""

    def __init__(self, index: int, setup: tuple[str, dict[str, Any]]) -> None:
        self.index = index
        parent_end, child_end = socket.socketpair()
        self.states = SharedStates(_shared_file(f"pipeline-engine-{index}"))
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from pipeline.model.engine_process import main; main()",
             str(child_end.fileno()), str(self.states.fd), str(os.getpid())],
            pass_fds=(child_end.fileno(), self.states.fd),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        child_end.close()
        self.conn = Connection(parent_end.detach())
        self.conn.send_bytes(pickle.dumps(setup, protocol=pickle.HIGHEST_PROTOCOL))

    def answer(self, timeout_s: float, what: str) -> tuple[str, Any]:
        """The child's next message; a ModelError when it is gone or silent."""
        try:
            if not self.conn.poll(timeout_s):
                self.kill()
                raise ModelError(
                    f"the OpenVINO replica process {self.index} did not {what} in "
                    f"{timeout_s:.0f} s: the engine is stuck (it was stopped; nothing of "
                    "this batch was written or committed)"
                )
            message: tuple[str, Any] = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise self.gone() from exc
        if message[0] == "failed":
            raise ModelError(f"OpenVINO cannot run this model here: {message[1]}")
        if message[0] == "bug":
            raise EngineChildError(f"the OpenVINO replica process failed:\n{message[1]}")
        return message

    def gone(self) -> ModelError:
        return ModelError(
            f"the OpenVINO replica process {self.index} {how_child_ended(self.process)} "
            "(out of memory?); nothing of this batch was written or committed: restart "
            "the worker"
        )

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()
        self.process.wait()
        self.conn.close()
        self.states.close()

    def close(self) -> None:
        """Ends the child: it exits when its end of the connection closes."""
        self.conn.close()
        try:
            self.process.wait(timeout=_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
        self.states.close()

    def cpu_seconds(self) -> float:
        """User and system CPU seconds so far (Linux's /proc; 0.0 elsewhere)."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class EngineProcesses:
    """`count` engine processes, each running the OpenVINO model at `xml` compiled
    with `properties`; `hidden` may be called from up to `count` threads at once."""

    def __init__(self, xml: str, properties: dict[str, Any], count: int, pass_timeout_s: float):
        self.pass_timeout_s = pass_timeout_s
        self._children = [_Child(index, (xml, properties)) for index in range(count)]
        self._idle: queue.Queue[_Child | None] = queue.Queue()  # None: one has failed
        self._failure: BaseException | None = None
        try:
            for child in self._children:
                child.answer(START_TIMEOUT_S, "start")
                self._idle.put(child)
        except BaseException:
            self.close()
            raise
        self._cpu_at_ready = self._cpu_now()

    @contextlib.contextmanager
    def hidden(self, input_ids: np.ndarray, mask: np.ndarray) -> Iterator[np.ndarray]:
        """The last hidden state (float32, rows x width x hidden) of int64 ids and mask,
        valid inside the block: the child's shared memory, which it runs no other pass
        into until the block ends."""
        child = self._take()
        try:
            request = (np.ascontiguousarray(input_ids), np.ascontiguousarray(mask))
            child.conn.send_bytes(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
            _, (shape, size) = child.answer(self.pass_timeout_s, "finish a pass")
            states = child.states.view(shape, size)
        except (EOFError, OSError) as exc:
            raise self._fail(child, child.gone()) from exc
        except BaseException as exc:
            self._fail(child, exc)
            raise
        try:
            yield states
        finally:
            self._idle.put(child)

    def _take(self) -> _Child:
        """An idle child; the first failure again once one has failed (every pass after
        it is abandoned with its batch)."""
        try:
            child = self._idle.get(timeout=self.pass_timeout_s)
        except queue.Empty:
            raise ModelError(
                f"no OpenVINO replica process was free for {self.pass_timeout_s:.0f} s"
            ) from None
        if child is None:
            self._idle.put(None)  # for the next one waiting
            raise ModelError(str(self._failure))
        return child

    def _fail(self, child: _Child, exc: BaseException) -> BaseException:
        """A child out of step with its requests is not used again, and neither are
        the others: the worker ends with this batch. Returns `exc`."""
        child.kill()
        if self._failure is None:
            self._failure = exc
            self._idle.put(None)
        return exc

    def cpu_seconds(self) -> float:
        """The engine processes' CPU seconds since they were ready, together."""
        return self._cpu_now() - self._cpu_at_ready

    def _cpu_now(self) -> float:
        return sum(child.cpu_seconds() for child in self._children)

    def close(self) -> None:
        for child in self._children:
            child.close()


def main() -> None:
    """The child: argv = SOCKET_FD STATES_FD PARENT_PID."""
    fd, states, parent = (int(arg) for arg in sys.argv[1:4])
    serve_as_child(fd, lambda conn: _serve(conn, SharedStates(states), parent), "bug")


def _serve(conn: Connection, states: SharedStates, parent: int) -> None:
    import openvino as ov

    xml, properties = pickle.loads(conn.recv_bytes())
    try:
        core = ov.Core()
        request = core.compile_model(core.read_model(xml), "CPU", properties).create_infer_request()
    except RuntimeError as exc:
        conn.send_bytes(pickle.dumps(("failed", last_line(exc))))
        return
    conn.send_bytes(pickle.dumps(("ready", None)))
    while True:
        while not conn.poll(_PARENT_CHECK_S):
            if os.getppid() != parent:
                return  # the worker is gone, and something else holds its end open
        input_ids, mask = pickle.loads(conn.recv_bytes())
        try:
            request.infer({"input_ids": input_ids, "attention_mask": mask})
        except RuntimeError as exc:  # the CPU lacks a kernel it needs (ONEDNN_MAX_CPU_ISA)
            conn.send_bytes(pickle.dumps(("failed", last_line(exc))))
            continue
        out = request.get_output_tensor(0).data
        np.copyto(states.fit(out.shape), out)
        conn.send_bytes(pickle.dumps(("hidden", (out.shape, states.size))))


def last_line(exc: Exception) -> str:
    """OpenVINO's errors nest a line per layer; the cause is the last one with text."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
