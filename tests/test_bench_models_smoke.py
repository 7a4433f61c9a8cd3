"""Smoke test of scripts/bench_models.py: two models side by side on a few texts.

It checks that the comparison runs and reports, not how fast anything is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_models_compares_two_models(
    tmp_path: Path, tiny_model: str, multilingual_model: str
) -> None:
    results = tmp_path / "models.json"
    command = [sys.executable, str(REPO / "scripts" / "bench_models.py")]
    command += ["--models", f"{tiny_model},multilingual-e5-small", "--records", "24"]
    command += ["--repeat", "1", "--json", str(results)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "texts/s" in proc.stdout and "vs first" in proc.stdout, proc.stdout
    rows = json.loads(results.read_text())["models"]
    assert [r["model"] for r in rows] == [tiny_model, "multilingual-e5-small"]
    assert all(r["texts_per_s"] > 0 for r in rows)
    assert rows[1]["document_prompt"] == "passage: " and rows[0]["document_prompt"] == ""
    assert len(rows[1]["paired_ratios"]) == 1
