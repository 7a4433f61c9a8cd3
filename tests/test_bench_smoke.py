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
    # The peers a user could pick instead, each with its gate figures, and the ratio to
    # the fastest that passes.
    assert "d/best" in out and "<- best" in out, out
    names = [p["rate"]["key"] for p in data["peers"]]
    assert names == [
        "b", "st-bf16", "onnx-fp32", "onnx-int8", "openvino-fp32", "openvino-int8"
    ]  # fmt: skip
    assert all(p["rate"]["per_s"] > 0 and 0 < p["cosine_mean"] <= 1.0001 for p in data["peers"])
    fp32_engines = [p for p in data["peers"] if p["rate"]["key"] in ("onnx-fp32", "openvino-fp32")]
    assert all(p["cosine_min"] >= 0.9999 and p["passed"] for p in fp32_engines)
    assert data["best_peer"] in names
    # With rounds, the contenders for "best" are timed again in each round, at their
    # medians. (On 64 records a contender's median may fall under a peer timed once.)
    retimed = [p for p in data["peers"] if p["rounds"]]
    assert retimed, data["peers"]
    assert all(len(p["rounds"]) == 2 and p["rate"]["per_s"] in p["rounds"] for p in retimed)
    assert "again (round 2 of 2)" in proc.stderr and "in 2 rounds:" in out, out
    # Where the time goes: (a)'s tokenizing, (d)'s stages and CPU.
    assert 0 < data["shares"]["a_tokenize"] < 1
    assert data["shares"]["d_embed"] > 0 and data["shares"]["d_cpu"] > 0
    assert "where the time goes" in out, out


@pytest.mark.integration
def test_overhead_gives_records_per_second_and_cpu_per_record(broker: str, tmp_path: Path) -> None:
    """scripts/overhead.py side by side with two variants: rates, CPU a record
    (the worker's read from /proc), ratios; the decoder variant runs too."""
    results = tmp_path / "overhead.json"
    command = [
        sys.executable,
        str(REPO / "scripts" / "overhead.py"),
        "--records",
        "3000",
        "--repeat",
        "1",
        "--tiny",
        "zero",
        "--bootstrap-servers",
        broker,
        "--variants",
        "batch=;kafka-python=PIPELINE_RECORD_DECODER=kafka-python",
        "--json",
        str(results),
    ]
    proc = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("CPU a record: bare") == 2, proc.stdout
    data = json.loads(results.read_text())
    assert data["bare"][0]["rate"] > 0 and data["bare"][0]["cpu_us"] > 0
    for variant in ("batch", "kafka-python"):
        (run,) = data["variants"][variant]["pipeline"]
        assert run["rate"] > 0 and run["startup_s"] > 0
        assert 0 < run["cpu_us"] < 10_000  # the worker's tree was read, per record
        assert 0 < run["worker_cpu_us"] <= run["cpu_us"]
        assert data["variants"][variant]["cpu_ratio"] > 0
