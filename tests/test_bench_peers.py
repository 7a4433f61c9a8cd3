"""The benchmark's "best" peer: which peers are timed again each round, and the
median their rounds give (scripts/harness/peers.py). No model, no broker."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from harness.numbers import Rate, Timer  # noqa: E402
from harness.peers import CONTENDER_SHARE, Peer, at_median, best, contenders  # noqa: E402


def peer(key: str, per_s: float, recall: float = 1.0) -> Peer:
    return Peer(rate(key, per_s), 1.0, 1.0, recall)


def rate(key: str, per_s: float) -> Rate:
    return Rate.timed(key, key, 3000, 3000 / per_s)


def timer(key: str) -> Timer:
    return Timer(key, key, 3000, lambda: None)


def test_contenders_are_the_passing_peers_near_the_fastest_that_passes() -> None:
    fastest, near, far = peer("fp32", 100.0), peer("bf16", 90.0), peer("onnx", 70.0)
    failing = peer("int8", 300.0, recall=0.8)  # faster, but under the gate: never "best"
    measured = [(p, timer(p.rate.key)) for p in (fastest, near, far, failing)]

    picked = [p.rate.key for p, _ in contenders(measured)]

    assert picked == ["fp32", "bf16"]
    assert 70.0 < CONTENDER_SHARE * 100.0 <= 90.0


def test_best_is_the_fastest_median_of_the_rounds() -> None:
    # One lucky first timing made bf16 look faster; its rounds say otherwise.
    first_fp32, first_bf16 = peer("fp32", 100.0), peer("bf16", 104.0)
    fp32 = at_median(first_fp32, [rate("fp32", r) for r in (99, 101, 98)])
    bf16 = at_median(first_bf16, [rate("bf16", r) for r in (90, 95, 93)])

    assert fp32.rate.per_s == pytest.approx(99) and bf16.rate.per_s == pytest.approx(93)
    assert fp32.rounds == pytest.approx((99, 101, 98))
    assert best([fp32, bf16]) is fp32
    assert (fp32.cosine_mean, fp32.recall_at_10) == (first_fp32.cosine_mean, 1.0)


def test_a_peer_not_timed_again_keeps_its_first_timing() -> None:
    first = peer("onnx", 70.0)
    assert at_median(first, []) is first
