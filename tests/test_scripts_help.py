"""Every script under scripts/ answers --help with its usage and exit 0, and does
nothing else: a script that took `--help` for an argument once built a 4 MB model
in a folder named `--help` where it was run. No broker."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
# Each: how to run it. The Python ones parse their arguments with argparse, the
# chaos package's entry point too; the shell ones answer -h/--help before any step.
COMMANDS = {
    **{p.name: [sys.executable, str(p)] for p in sorted(SCRIPTS.glob("*.py"))},
    "chaos": [sys.executable, str(SCRIPTS / "chaos")],
    **{p.name: ["bash", str(p)] for p in sorted(SCRIPTS.glob("*.sh"))},
}
# Their --help prints the usage but exits 2 for now (none left).
PENDING: set[str] = set()


def run_help(name: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    command = [*COMMANDS[name], "--help"]
    try:
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:  # one script's failure, not the others'
        return subprocess.CompletedProcess(command, -1, str(exc.stdout), f"timed out: {exc}")


@pytest.fixture(scope="module")
def answers(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[subprocess.CompletedProcess[str], list[str]]]:
    """Each script's answer to --help, run in an empty folder of its own, and what that
    folder holds afterwards; two at a time (most import torch)."""

    def one(name: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
        folder = tmp_path_factory.mktemp(name.replace(".", "-"))
        result = run_help(name, folder)
        return result, sorted(p.name for p in folder.iterdir())

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(COMMANDS, pool.map(one, COMMANDS), strict=True))


def test_every_script_is_covered() -> None:
    assert {"tiny_model.py", "chaos", "demo.sh", "bench.py"} <= set(COMMANDS)
    assert set(COMMANDS) >= PENDING


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.xfail(strict=True)) if name in PENDING else name
        for name in COMMANDS
    ],
)
def test_help_prints_the_usage_and_does_nothing_else(
    name: str, answers: dict[str, tuple[subprocess.CompletedProcess[str], list[str]]]
) -> None:
    result, left = answers[name]
    assert result.returncode == 0, result.stdout + result.stderr
    assert "usage:" in result.stdout.lower(), result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert left == [], f"{name} --help created {left} where it ran"


def test_the_benchmarks_and_the_chaos_runs_share_one_harness_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib

    monkeypatch.syspath_prepend(str(SCRIPTS))  # as the scripts run: their folder first
    harness = importlib.import_module("harness")
    for module in ("harness.broker", "harness.worker", "chaos.common", "chaos.broker"):
        assert importlib.import_module(module).HarnessError is harness.HarnessError, module
