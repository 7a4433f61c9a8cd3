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


CONTRACT_COMMANDS = {
    "topics",
    "produce",
    "run",
    "status",
    "search",
    "index",
    "model",
    "audit",
    "offsets",
    "compact",
}


def _listed_commands(help_text: str) -> set[str]:
    """The command names click lists under "Commands:" (first word of each line)."""
    lines = help_text.split("Commands:", 1)[1].splitlines()
    return {line.split()[0] for line in lines if line.startswith("  ") and line.strip()}


def test_console_script_lists_every_contract_command() -> None:
    script = Path(sys.executable).with_name("pipeline")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert _listed_commands(result.stdout) >= CONTRACT_COMMANDS


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
