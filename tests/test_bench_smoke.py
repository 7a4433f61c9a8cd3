"""Smoke test of scripts/bench.py: a tiny run through every variant prints the table.

It checks that the benchmark runs, not how fast anything is.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.integration
@pytest.mark.slow
def test_bench_runs_on_64_records_in_two_rounds(broker: str, tmp_path: Path) -> None:
    results = tmp_path / "bench.json"
    command = [
        sys.executable,
        str(REPO / "scripts" / "bench.py"),
        "--records",
        "64",
        "--partitions",
        "2",
        "--batch-size",
        "32",
        "--device",
        "cpu",
        "--bootstrap-servers",
        broker,
        "--json",
        str(results),
        "--timeout",
        "300",
        "--repeat",
        "2",
    ]
    proc = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=900, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for expected in ("texts/s", "(a) raw model", "(b) sentence-transformers", "(c) naive"):
        assert expected in out, out
    for expected in ("steady state", "process start to exit", "d/a", "d/b", "d/c"):
        assert expected in out, out
    assert "padding efficiency" in out, out
    assert "(a) in 2 rounds" in out and "(d) steady in 2 rounds" in out, out
    assert "recall@10" in out and ("PASS" in out or "FAIL" in out), out
    data = json.loads(results.read_text())
    assert set(data["rates"]) == {"a", "b", "c", "d_steady", "d_wall"}
    assert all(r["per_s"] > 0 for r in data["rates"].values())
    assert data["quality"]["rows"] == data["quality"]["expected"] == 64
    assert len(data["setup"]["rounds"]["a"]) == len(data["setup"]["rounds"]["d_steady"]) == 2
