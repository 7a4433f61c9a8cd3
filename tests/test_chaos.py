"""The chaos harness (scripts/chaos): its check on synthetic outputs, and a few seeds
against a real broker of its own (not the shared one on 9092).

The seeded runs cover the riskiest operations: several workers starting at the same
moment, a worker stalled past its session timeout, a broker restart, and workers
killed or stalled between a batch's dead letters and its publish.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from chaos import check, cli, common, plans, records  # noqa: E402

CHAOS_PORT = int(os.environ.get("PIPELINE_CHAOS_TEST_PORT", "19192"))
# Seed i runs scenario i (the plans are short ones): four workers starting at once with a
# SIGKILL and a join; three workers, one SIGSTOPped past the session timeout; a broker
# restart while workers run and another one during the --until-end run; one record in
# eight bad with SIGKILLs and a stall landing between dead letters and publish.
CHAOS_SEEDS = "9,8,11,1"
CHAOS_SCENARIOS = "together,stall,broker-restart,dead-letters"


def _good(text: str) -> bytes:
    return json.dumps({"id": "x", "text": text}).encode()


# -- the check, on synthetic outputs (no broker) ------------------------------------------


def test_bad_records_follow_the_contract() -> None:
    rng = random.Random(0)
    for kind, make in records.BAD_MAKERS.items():
        _, value = make(rng, "id-1")
        assert records.is_bad(value), kind
    assert not records.is_bad(_good("hello"))
    assert records.is_bad(None)
    assert records.is_bad(json.dumps({"text": "x" * (common.MAX_TEXT_BYTES + 1)}).encode())


def test_check_counts_lost_doubled_phantom_and_misrouted() -> None:
    real: dict[tuple[int, int], bytes | None] = {
        (0, 0): _good("a"),  # one row: fine
        (0, 1): _good("b"),  # no row: lost
        (0, 2): _good("c"),  # two rows: doubled
        (0, 3): b"{not json",  # dead-lettered: fine
        (0, 4): b"{not json",  # a row and a dead letter: doubled
        (1, 0): _good("d"),  # dead-lettered although good: misrouted
        (1, 1): _good("e"),  # a row with another record's text: mismatched
    }
    rows = [(0, 0, "a"), (0, 2, "c"), (0, 2, "c"), (0, 4, "?"), (1, 1, "zzz"), (1, 5, "aborted")]
    dlq = Counter({(0, 3): 2, (0, 4): 1, (1, 0): 1})
    verdict = check.check_records(real, rows, dlq)
    assert verdict.lost == [(0, 1)]
    assert verdict.doubled == [(0, 2), (0, 4)]
    assert verdict.phantom == [(1, 5)]
    assert verdict.misrouted == [(1, 0)]
    assert verdict.mismatched == [(1, 1)]
    assert verdict.dead_letter_repeats == 1
    assert verdict.bad_records == 2
    assert not verdict.clean


def test_check_index_and_commits() -> None:
    verdict = check.check_records({(0, 0): _good("a"), (0, 1): _good("b")}, [], Counter())
    rows = [(0, 0, "a"), (0, 1, "b")]
    check.check_index(verdict, rows, Counter({(0, 0): 2, (0, 7): 1}))
    assert verdict.index == {"missing": 1, "doubled": 1, "extra": 1}
    check.check_commits(verdict, {0: 2, 1: 3}, {0: 2, 1: 5, 2: 1})
    assert set(verdict.commits_short) == {1, 2}


def test_ranges_and_seeds() -> None:
    assert common.ranges([(0, 1), (0, 2), (0, 3), (0, 7), (2, 5)]) == {0: ["1-3", "7"], 2: ["5"]}
    assert cli.parse_seeds("1-3,7") == [1, 2, 3, 7]


def test_plans_are_seeded_and_cover_every_scenario() -> None:
    for name in plans.SCENARIOS:
        first, again = plans.make_plan(5, name), plans.make_plan(5, name)
        assert [str(s) for s in first.steps] == [str(s) for s in again.steps]
        assert first.steps[0].action == "start"
    assert plans.scenario_for(4, ["stall", "join"], 1) == "join"
    every = range(1, len(plans.SCENARIOS) + 1)
    assert {plans.scenario_for(s, None, 0) for s in every} == set(plans.SCENARIOS)


def test_tiny_model_loads_and_embeds(tmp_path: Path) -> None:
    from tiny_model import ensure_tiny_model

    from pipeline.model.embedder import Embedder

    folder = ensure_tiny_model(tmp_path / "tiny")
    assert ensure_tiny_model(folder) == folder  # cached: not rebuilt
    embedder = Embedder.load(str(folder), precision="fp32", device="cpu")
    vectors = embedder.embed(["a short text", "another one, a little longer"])
    assert vectors.shape == (2, 32)
    assert embedder.info.normalize and embedder.info.pooling == "mean"


# -- seeds against a real broker ----------------------------------------------------------


@pytest.mark.integration
@pytest.mark.slow
def test_chaos_seeds_lose_and_double_nothing(tmp_path: Path) -> None:
    results = tmp_path / "chaos.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "chaos"),
            "--seeds",
            CHAOS_SEEDS,
            "--scenario",
            CHAOS_SCENARIOS,
            "--port",
            str(CHAOS_PORT),
            "--kafka-home",
            str(common.CACHE / "chaos-kafka-test"),
            "--work-dir",
            str(tmp_path / "work"),
            "--json",
            str(results),
            "--keep-going",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    summary = json.loads(report.split("summary: ", 1)[1].splitlines()[0])
    assert summary["seeds"] == 4 and summary["passed"] == 4, report
    assert summary["lost"] == summary["doubled"] == summary["phantom"] == 0, report
    scenarios = {r["scenario"] for r in json.loads(results.read_text())["results"]}
    assert scenarios == set(CHAOS_SCENARIOS.split(","))
