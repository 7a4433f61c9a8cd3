"""What the chaos harness's parts share: paths, settings of the runs, and the log's time stamps."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

# The one class, the benchmarks' too; chaos's modules import it from here.
from harness import HarnessError as HarnessError

REPO = Path(__file__).resolve().parents[2]
_VENV_PYTHON = REPO / ".venv" / "bin" / "python"
PYTHON = str(_VENV_PYTHON if _VENV_PYTHON.exists() else Path(sys.executable))
DEV_KAFKA = REPO / "scripts" / "dev-kafka.sh"
FOREIGN_PRODUCER = REPO / "scripts" / "java" / "ForeignProducer.java"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))) / "embedding-pipeline"
SHARED_BROKER_PORT = 9092

CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
SESSION_TIMEOUT_MS = 6000
TMP_SUFFIX = ".tmp"  # pipeline.core.layout: files being written start with a dot and end so
BATCH_SIZES = (16, 32, 64, 128, 256)
SLOW_BATCH_SIZES = (64, 96, 128)  # with the slow model and long texts: seconds per batch
MAX_TEXT_BYTES = 65_536  # the worker's default cap (WorkerConfig.max_text_bytes)
MAX_CHUNKS = 128  # the worker's default --max-chunks (chunk mode: a record's chunks, at most)
READY = re.compile(r"model .* loaded")
# What the workers' logs say the chaos exercised (informational, per seed).
EXERCISED = {
    "session_expired": "Heartbeat session expired",
    "partitions_lost": "partitions lost:",
    "revoke_dropped": "not published within",
    "batch_dropped": "dropped partitions",
    "publish_race_lost": "was published by another worker first",
    "commit_failed": "offset commit failed",
    "quarantined": "damaged segment",
    "dead_letters_found": "dead-lettered by an earlier owner",
}


def log_stamp() -> str:
    """Wall-clock time formatted like the workers' log lines, to line them up."""
    now = datetime.now()
    return now.strftime("%Y-%m-%d %H:%M:%S,") + f"{now.microsecond // 1000:03d}"


# ---------------------------------------------------------------------------- the broker


def ranges(keys: Iterable[tuple[int, int]]) -> dict[int, list[str]]:
    """{partition: ["a-b", "c", ...]} of (partition, offset) pairs, for reports."""
    by_partition: dict[int, list[int]] = {}
    for partition, offset in sorted(set(keys)):
        by_partition.setdefault(partition, []).append(offset)
    result: dict[int, list[str]] = {}
    for partition, offsets in by_partition.items():
        spans: list[list[int]] = []
        for offset in offsets:
            if spans and offset == spans[-1][1] + 1:
                spans[-1][1] = offset
            else:
                spans.append([offset, offset])
        result[partition] = [f"{a}-{b}" if a != b else str(a) for a, b in spans]
    return result
