"""What a new user touches first: the console script, the compose file, the scripts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _has_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
    return probe.returncode == 0


def test_console_script_lists_every_contract_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0
    for command in ("topics", "produce", "run", "status", "search", "index", "model"):
        assert command in result.stdout


@pytest.mark.skipif(not _has_compose(), reason="docker compose is not installed")
@pytest.mark.parametrize("profile", [[], ["--profile", "gpu"]])
def test_docker_compose_file_is_valid(profile: list[str]) -> None:
    result = subprocess.run(
        ["docker", "compose", *profile, "config", "--quiet"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_dev_kafka_script_reports_status() -> None:
    result = subprocess.run(
        [str(REPO / "scripts" / "dev-kafka.sh"), "bogus"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "usage" in result.stderr
