"""Expected operational failures end in ONE actionable line and a non-zero exit code.

Each case runs the real command (`python -m pipeline.cli ...`) as a subprocess and
checks: the exit code is the `PipelineError` subclass's, stderr has exactly one
line starting with `error:` (log lines, which start with a timestamp, aside), the
line says what went wrong, and there is no traceback. Disk full also checks that
no offset was committed past the rows that reached published Parquet files.
"""

from __future__ import annotations

import base64
import errno
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.embedder import ModelInfo
from pipeline.errors import (
    BrokerUnavailable,
    ConfigError,
    ModelError,
    OutputError,
    PipelineError,
    TopicMissing,
)
from pipeline.records import GoodRecord, SourceRecord
from sinks import parquet
from sinks.layout import SegmentName, iter_segments
from tests.helpers import (
    PIPELINE,
    REPO,
    committed_offsets,
    publish_json,
    run_until_end,
    worker_args,
    worker_env,
)

UNREACHABLE = "127.0.0.1:1"
_LOG_LINE = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}")


def pipeline(
    *args: str, bootstrap: str = UNREACHABLE, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Runs `python -m pipeline.cli ARGS` with PIPELINE_BOOTSTRAP_SERVERS=bootstrap."""
    return subprocess.run(
        [*PIPELINE, *args],
        env=worker_env(bootstrap),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def error_line(result: subprocess.CompletedProcess[str], error: type[PipelineError]) -> str:
    """Asserts the one-line failure contract and returns the `error:` line."""
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    assert result.returncode != 0, output
    assert result.returncode == error.exit_code, output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    unexpected = [
        line
        for line in result.stderr.splitlines()
        if line.strip() and not _LOG_LINE.match(line) and not line.startswith("error:")
    ]
    # The one other line tolerated: transformers' progress bar while the model loads.
    assert all("Loading weights" in line for line in unexpected), result.stderr
    return errors[0]


def run_args(topic: str, output: Path, *extra: str) -> list[str]:
    """`run ...` arguments (without the interpreter) for a worker in fp32."""
    return worker_args(topic, "g-errors", output, *extra)[len(PIPELINE) :]


# ------------------------------------------------------------------ broker unreachable


UNREACHABLE_COMMANDS = {
    "run": "run --topic t --group g --output {out} --precision fp32",
    "status": "status --group g",
    "produce": "produce t {input}",
    "topics-create": "topics create t --partitions 1",
}


@pytest.fixture(scope="module")
def unreachable_results(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[subprocess.CompletedProcess[str], float]]:
    """(result, seconds) of each command, run side by side: they mostly wait."""
    tmp = tmp_path_factory.mktemp("unreachable")
    source = tmp / "in.jsonl"
    source.write_text('{"text": "hello"}\n')

    def timed(args: str) -> tuple[subprocess.CompletedProcess[str], float]:
        command = args.format(out=tmp / "out", input=source).split()
        started = time.monotonic()
        result = pipeline("--bootstrap-servers", UNREACHABLE, *command)
        return result, time.monotonic() - started

    with ThreadPoolExecutor(len(UNREACHABLE_COMMANDS)) as pool:
        futures = {name: pool.submit(timed, args) for name, args in UNREACHABLE_COMMANDS.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("command", list(UNREACHABLE_COMMANDS))
def test_broker_unreachable_fails_fast_in_one_line(
    command: str,
    unreachable_results: dict[str, tuple[subprocess.CompletedProcess[str], float]],
) -> None:
    result, elapsed = unreachable_results[command]

    line = error_line(result, BrokerUnavailable)
    assert UNREACHABLE in line
    assert "--bootstrap-servers" in line  # says how to fix it
    assert elapsed < 20, f"took {elapsed:.1f}s to report an unreachable broker"


# ------------------------------------------------------------------ topic missing


@pytest.mark.integration
def test_run_on_missing_topic(broker: str, tmp_path: Path) -> None:
    topic = "missing-topic-for-test-errors"
    result = pipeline(*run_args(topic, tmp_path / "out"), bootstrap=broker)

    line = error_line(result, TopicMissing)
    assert topic in line
    assert "pipeline topics create" in line
    assert not (tmp_path / "out" / "vectors").exists() or not any(
        (tmp_path / "out" / "vectors").iterdir()
    )


@pytest.mark.integration
def test_produce_to_missing_topic(broker: str, tmp_path: Path) -> None:
    topic = "missing-topic-for-test-errors"
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "hello"}\n')

    result = pipeline("produce", topic, str(source), bootstrap=broker)

    line = error_line(result, TopicMissing)
    assert topic in line


# ------------------------------------------------------------------ output, model


@pytest.mark.integration
def test_output_directory_not_writable(
    broker: str, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    # As root permission bits do not stop writes: a path under a regular file does.
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    output = blocker / "out"

    result = pipeline(*run_args(make_topic(), output), bootstrap=broker)

    line = error_line(result, OutputError)
    assert str(blocker) in line
    assert blocker.read_text() == "not a directory"


@pytest.mark.integration
def test_model_path_missing(broker: str, make_topic: Callable[..., str], tmp_path: Path) -> None:
    result = pipeline(
        *run_args(make_topic(), tmp_path / "out", "--model", "/nonexistent/dir"), bootstrap=broker
    )

    line = error_line(result, ModelError)
    assert "/nonexistent/dir" in line


# ------------------------------------------------------------------ bad configuration


def test_batch_size_zero(tmp_path: Path) -> None:
    result = pipeline(*run_args("t", tmp_path / "out", "--batch-size", "0"))

    assert "batch size" in error_line(result, ConfigError)


def test_unknown_key_in_config_file(tmp_path: Path) -> None:
    config = tmp_path / "pipeline.toml"
    config.write_text("[run]\nbatch_sise = 64\n")

    result = pipeline("--config", str(config), *run_args("t", tmp_path / "out"))

    line = error_line(result, ConfigError)
    assert "batch_sise" in line
    assert str(config) in line


def test_unknown_global_key_in_config_file(tmp_path: Path) -> None:
    config = tmp_path / "pipeline.toml"
    config.write_text('bootstrap_server = "127.0.0.1:9092"\n')

    result = pipeline("--config", str(config), "status", "--group", "g")

    assert "bootstrap_server" in error_line(result, ConfigError)


@pytest.mark.parametrize("servers", ["localhost", "127.0.0.1:port", ":9092", ","])
def test_bad_bootstrap_servers_format(servers: str, tmp_path: Path) -> None:
    result = pipeline("--bootstrap-servers", servers, "status", "--group", "g")

    assert "HOST:PORT" in error_line(result, ConfigError)


@pytest.mark.parametrize("codec", ["snappy", "lz4", "zstd"])
def test_compression_without_its_package(codec: str, tmp_path: Path) -> None:
    from kafka import codec as codecs

    if getattr(codecs, f"has_{codec}")():
        pytest.skip(f"the {codec} package is installed here")
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "hello"}\n')

    result = pipeline("produce", "t", str(source), "--compression", codec)

    line = error_line(result, ConfigError)
    assert codec in line
    assert "pip install" in line


# ------------------------------------------------------------------ disk full


@pytest.fixture
def tiny_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (needs root and mount rights; skipped where mounting fails)."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def records_with_blobs(n: int) -> Iterator[dict[str, str]]:
    """Short texts (cheap to embed) with an incompressible metadata field (big rows)."""
    for i in range(n):
        blob = base64.b64encode(os.urandom(12_000)).decode()
        yield {"id": f"r{i}", "text": f"record {i}: the quick brown fox jumps", "blob": blob}


@pytest.mark.integration
def test_disk_full_stops_with_one_line_and_commits_only_published_rows(
    broker: str, make_topic: Callable[..., str], group_id: str, tiny_filesystem: Path
) -> None:
    topic = make_topic(partitions=3)
    # ~17.5 KB a row (384 float32 + 16 KB of base64 metadata): 150 rows need ~2.6 MB.
    publish_json(broker, topic, records_with_blobs(150), partitions=3)
    output = tiny_filesystem / "out"

    # A short max poll interval bounds the wait, on close, for the batch that failed.
    options = ["--batch-size", "24", "--max-poll-interval-ms", "10000"]
    options += ["--session-timeout-ms", "6000"]

    result = run_until_end(broker, topic, group_id, output, *options, timeout=180)

    line = error_line(result, OutputError)
    assert "disk full" in line
    published = published_coverage(output, topic)
    assert published, "nothing was published before the disk filled up"
    committed = committed_offsets(broker, group_id, topic)
    for partition, offset in committed.items():
        last = published.get(partition, -1)
        assert offset is None or offset <= last + 1, (partition, offset, last)


def published_coverage(output: Path, topic: str) -> dict[int, int]:
    """Last offset covered per partition; asserts every published file reads whole."""
    last: dict[int, int] = {}
    for name, path in iter_segments(output):
        table = pq.read_table(path)  # a truncated file would raise here
        offsets = np.asarray(table["offset"].to_pylist(), dtype=np.int64)
        assert set(table["topic"].to_pylist()) <= {topic}
        assert ((offsets >= name.first) & (offsets <= name.last)).all(), path
        assert table.num_rows == name.last - name.first + 1, path  # no bad records here
        last[name.partition] = max(last.get(name.partition, -1), name.last)
    return last


def test_disk_full_while_staging_is_an_output_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unit-level twin of the test above, for where no tmpfs can be mounted."""
    info = ModelInfo("m", "/m", "r", 4, "mean", True, 128, "fp32", "cpu")
    sink = parquet.ParquetSink(tmp_path, info)
    sink.prepare()
    source = SourceRecord("t", 0, 0, 0, None, b'{"text": "x"}')
    record = GoodRecord(source, "x", None, None)

    def no_space(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    for target in ("write_table", "fsync"):
        with monkeypatch.context() as patch:
            if target == "write_table":
                patch.setattr(parquet.pq, "write_table", no_space)
            else:
                patch.setattr(parquet.os, "fsync", no_space)
            with pytest.raises(OutputError, match="disk full"):
                sink.stage(SegmentName("t", 0, 0, 0), [record], np.zeros((1, 4), np.float32))
        assert not [p for p in sink.directory.iterdir() if p.name.endswith(".parquet")]
        assert not list(sink.directory.glob(".*.tmp"))  # the partial temp file is gone
