"""A worker's compaction, run in a child process.

Compacting a nearline output reads thousands of small files' footers and encodes
tens of MB of Parquet: seconds of Python and Arrow work. In the worker's own
process that work held the GIL against the poll loop (nearline records waited
behind it) and left its buffers in the worker's allocators (RSS up by about the
size of a merge, kept after it). A child process gives both back when it exits.

The child runs `sinks.compaction.compact` under the same locks (flock, so they
hold between processes too), stops between merged files on SIGTERM, and dies
with the worker (PR_SET_PDEATHSIG on Linux): a crash at any step leaves a
readable dataset, as compaction guarantees anyway.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from pipeline.core.errors import OutputError, PipelineError
from pipeline.core.host import die_with_parent
from sinks.compaction import CompactionReport, compact

# How long a stopping child may take to finish the merge it is in.
STOP_GRACE_S = 10.0
_POLL_S = 0.2


def compact_in_child(
    output: Path, target_bytes: int, stop: threading.Event, purge: bool = False
) -> CompactionReport | None:
    """Compacts `output` in a child process (with `purge`, purges it: sinks.purge); None
    when `stop` was set meanwhile.

    Raises OutputError with the child's own one-line reason when it fails."""
    child = subprocess.Popen(
        [sys.executable, "-c", "from sinks.compact_process import main; main()",
         str(output), str(target_bytes), str(os.getpid()), "purge" if purge else "compact"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    while True:
        if stop.is_set():
            _stop(child)
            return None
        try:  # reads the pipes as it waits, so a chatty child never blocks on them
            out, err = child.communicate(timeout=_POLL_S)
            break
        except subprocess.TimeoutExpired:
            continue
    if child.returncode != 0:
        lines = err.strip().splitlines()
        raise OutputError(lines[-1] if lines else f"compaction exited with {child.returncode}")
    return CompactionReport(**json.loads(out))


def _stop(child: subprocess.Popen) -> None:
    child.terminate()
    try:
        child.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()  # compaction is crash-safe: the next one removes its staging
        child.communicate()


def main() -> None:
    """The child: argv = OUTPUT TARGET_BYTES PARENT_PID [compact|purge]; the compaction's
    report as JSON on stdout."""
    output, target_bytes, parent = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    purging = sys.argv[4:5] == ["purge"]
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    die_with_parent()
    if os.getppid() != parent:
        return  # the worker died before the death signal was armed
    try:
        if purging:
            from sinks.purge import purge

            report = purge(output, target_bytes, should_stop=stopping.is_set).compaction
        else:
            report = compact(output, target_bytes, should_stop=stopping.is_set)
    except PipelineError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
    print(json.dumps(report.as_dict()))
