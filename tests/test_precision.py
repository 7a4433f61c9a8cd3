"""The precision gate: similarity measures, the choice of the fastest passing
precision, and the remembered choice per model, device and gate."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pipeline.core.corpus import sample_texts
from pipeline.core.errors import ModelError
from pipeline.core.host import CpuPlan
from pipeline.model import precision as precision_mod
from pipeline.model.embedder import Embedder, engine_for
from pipeline.model.precision import (
    Gate,
    PrecisionReport,
    cache_path,
    check_precisions,
    choose,
    cosine_rows,
    neighbour_recall,
    remember,
    remembered,
    resolve_precision,
)


def report(precision: str, rate: float, passed: bool) -> PrecisionReport:
    cos = 1.0 if passed else 0.9
    return PrecisionReport(precision, "cpu", cos, cos, cos, rate, passed, engine_for(precision))


REPORTS = [report("fp32", 100.0, True), report("bf16", 250.0, True), report("int8", 400.0, False)]


def clustered(n: int = 120, dim: int = 32, seed: int = 0) -> np.ndarray:
    """Vectors in clusters, so that nearest neighbours are meaningful."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((12, dim))
    return (centres[rng.integers(0, 12, n)] + 0.3 * rng.standard_normal((n, dim))).astype(
        np.float32
    )


@pytest.fixture(autouse=True)
def offered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The precisions every device offers here, whatever this machine's CPU and GPU."""
    monkeypatch.setattr(precision_mod, "candidates_for", lambda _device: ["int8", "bf16"])


def choice(model: str, device: str, gate: Gate) -> str | None:
    reports = remembered(model, device, gate)
    return None if reports is None else choose(reports).precision


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def fast_revision(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Skips hashing the 90 MB of weights on every cache look-up; the value can be changed."""
    revision = {"value": "sha256:aaaaaaaaaaaaaaaa"}
    monkeypatch.setattr(precision_mod, "_identity", lambda _model: revision["value"])
    return revision


# ------------------------------------------------------------------ measures


def test_cosine_rows() -> None:
    a = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0], [1.0, 1.0]])
    b = np.array([[5.0, 0.0], [1.0, 0.0], [-3.0, -4.0], [0.0, 0.0]])
    np.testing.assert_allclose(cosine_rows(a, b), [1.0, 0.0, -1.0, 0.0], atol=1e-12)
    v = clustered(10)
    np.testing.assert_allclose(cosine_rows(v, 7 * v), 1.0, rtol=1e-6)


def test_neighbour_recall_identical_sets_is_one() -> None:
    v = clustered()
    assert neighbour_recall(v, v) == 1.0
    assert neighbour_recall(v, 3.0 * v) == 1.0  # scale does not change neighbours


def test_neighbour_recall_drops_for_shuffled_or_perturbed_sets() -> None:
    v = clustered()
    rng = np.random.default_rng(1)
    shuffled = v[rng.permutation(len(v))]
    slightly = v + 0.01 * rng.standard_normal(v.shape).astype(np.float32)
    heavily = v + 3.0 * rng.standard_normal(v.shape).astype(np.float32)
    r_shuffled = neighbour_recall(v, shuffled)
    r_slight = neighbour_recall(v, slightly)
    r_heavy = neighbour_recall(v, heavily)
    assert r_shuffled < 0.3
    assert r_heavy < 0.5
    assert 0.9 <= r_slight <= 1.0
    assert r_heavy < r_slight


def test_neighbour_recall_small_sets() -> None:
    v = clustered(5)
    assert neighbour_recall(v, v, k=10) == 1.0  # k clipped to n - 1
    assert neighbour_recall(v[:1], v[:1]) == 1.0  # no neighbours at all


# ------------------------------------------------------------------ choice


def test_choose_picks_the_fastest_passing_precision() -> None:
    assert choose(REPORTS).precision == "bf16"  # int8 is faster but failed the gate


def test_choose_falls_back_to_fp32() -> None:
    reports = [report("fp32", 100.0, True), report("bf16", 300.0, False)]
    assert choose(reports).precision == "fp32"


def test_choose_within_the_kind_an_output_holds() -> None:
    reports = [
        report("fp32", 100.0, True),
        report("bf16", 250.0, True),
        report("int8", 400.0, True),
    ]
    assert choose(reports).precision == "int8"
    assert choose(reports, ("fp32", "bf16", "fp16")).precision == "bf16"
    assert choose(reports, ("int8",)).precision == "int8"
    failed = [reports[0], report("int8", 400.0, False)]
    with pytest.raises(ModelError, match="holds int8 vectors and no such precision passes"):
        choose(failed, ("int8",))


def test_a_compared_engine_is_never_chosen() -> None:
    """OpenVINO fp32 is a row of `pipeline model check`, not something --precision runs."""
    faster = replace(report("fp32", 900.0, True), engine="openvino")
    assert not faster.selectable
    assert choose([report("fp32", 100.0, True), faster]).engine == "torch"


def test_a_choice_measured_without_a_new_precision_is_measured_again(
    cache_home: Path, fast_revision: dict
) -> None:
    """A cache written before int8 was offered (or before OpenVINO was installed) is
    stale: auto measures again rather than never trying int8."""
    remember("default", "cpu", Gate(), [REPORTS[0], REPORTS[1]])
    assert remembered("default", "cpu", Gate()) is None


def test_choose_may_keep_fp32_when_it_is_fastest() -> None:
    reports = [report("fp32", 500.0, True), report("bf16", 300.0, True)]
    assert choose(reports).precision == "fp32"


# ------------------------------------------------------------------ remembering


def test_remember_round_trip(cache_home: Path) -> None:
    gate = Gate()
    assert remembered("default", "cpu", gate) is None  # nothing cached yet
    remember("default", "cpu", gate, REPORTS)
    assert cache_path() == cache_home / "embedding-pipeline" / "precision.json"
    assert cache_path().is_file()
    assert choice("default", "cpu", gate) == "bf16"
    assert remembered("default", "cpu", gate) == REPORTS
    data = json.loads(cache_path().read_text())
    (entry,) = data.values()
    assert entry["choice"] == "bf16"
    assert [r["precision"] for r in entry["reports"]] == ["fp32", "bf16", "int8"]
    assert list(cache_home.glob("embedding-pipeline/*.tmp")) == []


def test_gate_mismatch_is_not_remembered(cache_home: Path, fast_revision: dict) -> None:
    remember("default", "cpu", Gate(), REPORTS)
    assert remembered("default", "cpu", Gate(min_cosine_mean=0.999)) is None
    assert remembered("default", "cpu", Gate(min_recall_at_10=0.5)) is None
    assert choice("default", "cpu", Gate()) == "bf16"


def test_other_device_is_not_remembered(cache_home: Path, fast_revision: dict) -> None:
    remember("default", "cpu", Gate(), REPORTS)
    assert remembered("default", "cuda", Gate()) is None


def test_another_layout_is_measured_again(cache_home: Path, fast_revision: dict) -> None:
    """Which precision is fastest depends on the replicas and threads it runs on."""
    one, two = CpuPlan(1, 2, 2), CpuPlan(2, 1, 2)
    remember("default", "cpu", Gate(), REPORTS, one)
    assert remembered("default", "cpu", Gate(), one) is not None
    assert remembered("default", "cpu", Gate(), two) is None


def test_other_model_revision_is_not_remembered(
    cache_home: Path, fast_revision: dict[str, str]
) -> None:
    remember("default", "cpu", Gate(), REPORTS)
    fast_revision["value"] = "sha256:bbbbbbbbbbbbbbbb"
    assert remembered("default", "cpu", Gate()) is None


def test_remember_keeps_other_entries_and_survives_a_corrupt_cache(
    cache_home: Path, fast_revision: dict
) -> None:
    path = cache_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert remembered("default", "cpu", Gate()) is None
    strict, loose = Gate(0.9999, 0.99), Gate(0.5, 0.5)
    remember(
        "default", "cpu", strict, [REPORTS[0], report("int8", 1, False), report("bf16", 1, False)]
    )
    remember("default", "cuda", loose, [replace(r, device="cuda") for r in REPORTS])
    assert choice("default", "cpu", strict) == "fp32"
    assert choice("default", "cuda", loose) == "bf16"


def test_resolve_precision_uses_the_remembered_choice(
    cache_home: Path, fast_revision: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_measuring(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("measured although the choice was remembered")

    monkeypatch.setattr(precision_mod, "check_precisions", no_measuring)
    assert resolve_precision("default", "cpu", "fp32", list) == "fp32"  # explicit: as asked
    remember("default", "cpu", Gate(), REPORTS)
    # The sample is not even gathered: it cost seconds of every start-up.
    assert resolve_precision("default", "cpu", "auto", no_measuring) == "bf16"


# ------------------------------------------------------------------ the gate on real vectors


@pytest.fixture(scope="module")
def int8_embedder() -> Embedder:
    return Embedder.load("default", precision="int8", device="cpu")


def test_check_precisions_on_real_text(
    embedder: Embedder, int8_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = {"fp32": embedder, "int8": int8_embedder}
    monkeypatch.setattr(
        precision_mod.Embedder,
        "load",
        staticmethod(lambda *_a, precision="fp32", **_k: loaded[precision]),
    )
    monkeypatch.setattr(Embedder, "close", lambda _self: None)  # module-scoped fixtures
    texts = sample_texts(512)[:16]
    strict = Gate(0.99999, 0.999)
    reports = check_precisions("default", "cpu", texts, ["int8"], strict)
    assert [(r.precision, r.engine) for r in reports] == [("fp32", "torch"), ("int8", "openvino")]
    fp32, int8 = reports
    assert (fp32.cosine_mean, fp32.recall_at_10, fp32.passed) == (1.0, 1.0, True)
    assert 0.99 < int8.cosine_min <= int8.cosine_mean < 0.99999
    assert 0.0 < int8.recall_at_10 <= 1.0
    assert int8.texts_per_s > 0
    assert not int8.passed  # a gate stricter than int8 keeps
    assert choose(reports).precision == "fp32"


def test_int8_passes_the_gate_on_held_out_text(embedder: Embedder, int8_embedder: Embedder) -> None:
    """The promise of `--precision auto` picking int8: on text the gate's sample does
    not hold (the stdlib sample past the worker's 256), the default gate holds with
    a margin. The mean cosine and recall@10 measured: 0.9995 and 0.975."""
    texts = sample_texts(1200)[256:1200]
    fp32, int8 = embedder.embed(texts), int8_embedder.embed(texts)
    cos = cosine_rows(fp32, int8)
    assert cos.mean() >= 0.999
    assert cos.min() >= 0.99
    assert neighbour_recall(fp32, int8) >= 0.96
