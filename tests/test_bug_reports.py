"""A bug ends a command with its traceback, one line asking for a report and exit 70
(EX_SOFTWARE); an expected failure stays one `error:` line and its own code
(tests/test_errors.py holds the contract for those). A bug in a stage thread or in
the tokenizer process keeps the traceback of where it happened."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from consumers.tokenize_process import TokenizerChildError, TokenizerProcess
from pipeline.cli.options import BUG_EXIT_CODE
from pipeline.core.errors import OutputError, PipelineError
from pipeline.core.records import RecordParser, SourceRecord
from tests.helpers import REPO, corpus_records, publish_json, worker_args, worker_env
from tests.test_errors import error_line

BUG_LINE = (
    "error: this is a bug in the pipeline, not a problem with its set-up; "
    "please report it with the traceback above"
)


def patched_pipeline(patch: str, *args: str) -> list[str]:
    """`python -m pipeline.cli ARGS`, after running `patch` (Python source) in the process."""
    return [sys.executable, "-c", f"{patch}\nfrom pipeline.cli import main\nmain()", *args]


def run(command: list[str], bootstrap: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        command,
        env=worker_env(bootstrap),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_bug_report(result: subprocess.CompletedProcess, error: str, frame: str) -> None:
    """Exit 70, the traceback down to `error` through `frame` (a function of the code
    that failed), then the line asking for a report, last."""
    assert result.returncode == BUG_EXIT_CODE, result.stderr
    stderr = result.stderr
    assert "Traceback (most recent call last):" in stderr, stderr
    assert error in stderr, stderr
    assert f", in {frame}\n" in stderr, stderr
    assert stderr.rstrip().splitlines()[-1] == BUG_LINE, stderr
    assert stderr.count("error:") == 1, stderr


def test_a_bug_in_a_command_prints_its_traceback_and_exits_70() -> None:
    patch = (
        "import sys, pipeline.cli\n"
        "cli_main = sys.modules['pipeline.cli.main']  # the package's `main` is the group\n"
        "def _kafka_settings(values):\n"
        "    raise TypeError('planted: settings from a dict of the wrong shape')\n"
        "cli_main._kafka_settings = _kafka_settings\n"
    )
    result = run(patched_pipeline(patch, "status", "--group", "g"), "127.0.0.1:1", 60)

    assert_bug_report(result, "TypeError: planted: settings", "_kafka_settings")


def test_click_usage_errors_and_help_keep_their_exit_codes() -> None:
    assert run(patched_pipeline("", "--help"), "127.0.0.1:1", 60).returncode == 0
    usage = run(patched_pipeline("", "status"), "127.0.0.1:1", 60)  # no --group
    assert usage.returncode == 64 and "Traceback" not in usage.stderr, usage.stderr


# ------------------------------------------------------------------ the worker's stages

WRITE_STAGE_RAISES = """
import consumers.stages as stages
from pipeline.core.errors import OutputError
def handle(self, item):
    raise {error}
stages.WriteStage.handle = handle
"""


@pytest.fixture
def stage_run(
    broker: str, make_topic: Callable[..., str], tiny_model: str, tmp_path: Path
) -> Callable[[str], subprocess.CompletedProcess]:
    """Runs a bulk worker over a few records with the write stage raising `error` (Python
    source of an exception) at its first batch."""
    topic = make_topic()
    publish_json(broker, topic, corpus_records(20))

    def run_with(error: str) -> subprocess.CompletedProcess:
        args = worker_args(topic, "g-bugs", tmp_path / "out", "--model", tiny_model)
        args += ["--until-end", "--tokenizer-process", "off"]
        patch = WRITE_STAGE_RAISES.format(error=error)
        return run(patched_pipeline(patch, *args[3:]), broker)

    return run_with


@pytest.mark.integration
def test_a_bug_in_a_stage_keeps_the_stage_threads_traceback(
    stage_run: Callable[[str], subprocess.CompletedProcess],
) -> None:
    result = stage_run("AttributeError(\"'NoneType' object has no attribute 'rows' (planted)\")")

    assert_bug_report(
        result, "AttributeError: 'NoneType' object has no attribute 'rows' (planted)", "handle"
    )
    assert "the write stage failed" not in result.stderr  # no more one-line wrapper


@pytest.mark.integration
def test_an_expected_failure_in_a_stage_stays_one_line(
    stage_run: Callable[[str], subprocess.CompletedProcess],
) -> None:
    result = stage_run("OutputError('disk full (planted)')")

    assert error_line(result, OutputError) == "error: disk full (planted)"


# ------------------------------------------------------------------ the tokenizer process


def test_a_bug_in_the_tokenizer_process_comes_back_with_its_traceback() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    # A setting of the wrong type, as a bug would hand it over: parsing a value fails.
    parser = RecordParser(max_text_bytes="65536")  # type: ignore[arg-type]
    child = TokenizerProcess.start(tokenizer.to_str(), 8, parser=parser)
    try:
        child.submit_values([b'{"text": "a"}'])
        with pytest.raises(TokenizerChildError) as raised:
            child.parsed_result([SourceRecord("t", 0, 0, 0, None, b'{"text": "a"}')])
    finally:
        child.close()
    message = str(raised.value)
    assert not isinstance(raised.value, PipelineError)  # not an expected, one-line failure
    assert "Traceback (most recent call last):" in message, message
    assert ", in _validate\n" in message and "TypeError: unsupported operand" in message, message
