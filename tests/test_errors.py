"""Expected operational failures end in ONE actionable line and a non-zero exit code.

Each case runs the real command (`python -m pipeline.cli ...`) as a subprocess and
checks: the exit code is the `PipelineError` subclass's, stderr has exactly one
line starting with `error:` (log lines, which start with a timestamp, aside), the
line says what went wrong, and there is no traceback. Disk full also checks that
no offset was committed past the rows that reached published Parquet files.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pipeline.core.errors import (
    BrokerUnavailable,
    ConfigError,
    ModelError,
    OutputError,
    PipelineError,
    TopicMissing,
)
from tests.helpers import (
    PIPELINE,
    REPO,
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
