"""Precision behind a quality gate.

A lower precision is only worth having when its vectors still find the same
neighbours. `check_precisions()` embeds a sample of real text at fp32 and at each
candidate precision and reports mean and minimum cosine against fp32, neighbour
recall@10 (within the sample) and texts/s. `--precision auto` takes the fastest
precision that passes the gate and remembers the choice per model and device.

Each precision runs on its engine (pipeline.model.embedder.engine_for: int8 on
OpenVINO, the float ones on torch); `pipeline model check` measures OpenVINO at fp32
too, a row to compare engines by that auto does not pick.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pipeline.core.errors import ModelError
from pipeline.core.host import CpuPlan, plan_cpu, usable_cpus
from pipeline.model import openvino_engine
from pipeline.model.embedder import Embedder, cpu_has_native_bf16, engine_for, pick_device
from pipeline.model.gate import (  # noqa: F401  (the gate's names, read from here too)
    DEFAULT_GATE,
    DEFAULT_MIN_COSINE,
    DEFAULT_MIN_RECALL,
    Gate,
    cosine_rows,
    neighbour_recall,
)
from pipeline.model.spec import ModelSpec

log = logging.getLogger(__name__)

SAMPLE_SIZE = 512


@dataclass(frozen=True)
class PrecisionReport:
    precision: str
    device: str
    cosine_mean: float
    cosine_min: float
    recall_at_10: float
    texts_per_s: float
    passed: bool
    engine: str = "torch"

    @property
    def selectable(self) -> bool:
        """Whether `--precision` runs this row (its precision on its own engine)."""
        return self.engine == engine_for(self.precision)


def candidates_for(device: str) -> list[str]:
    """Precisions worth measuring on this device, fastest first."""
    if device == "cuda":
        import torch

        return ["bf16", "fp16"] if torch.cuda.is_bf16_supported() else ["fp16"]
    native = ["bf16"] if cpu_has_native_bf16() else []
    return ["int8", *native] if openvino_engine.available() else native


def engine_rows(device: str) -> list[tuple[str, str]]:
    """(precision, engine) rows `pipeline model check` adds to compare engines by."""
    return [("fp32", "openvino")] if device == "cpu" and openvino_engine.available() else []


def check_precisions(
    model: str | ModelSpec,
    device: str,
    texts: list[str],
    precisions: list[str] | None = None,
    gate: Gate = DEFAULT_GATE,
    sub_batch_tokens: int | None = None,
    extra_engines: bool = False,
    plan: CpuPlan | None = None,
) -> list[PrecisionReport]:
    """fp32 on torch first (the reference), then each precision on its engine;
    `extra_engines`: the engine_rows too. A precision whose engine cannot run the
    model (an architecture OpenVINO does not convert) is reported as failed. Each
    runs laid out as `plan` (None: as a worker on this host, `layout_of`): which
    precision is fastest depends on it (torch's bf16 gained more from two replicas
    than OpenVINO's int8 did from two threads)."""
    device = pick_device(device)
    plan = plan or layout_of(device)
    spec = _spec(model)
    wanted = candidates_for(device) if precisions is None else precisions
    rows = [(p, engine_for(p)) for p in wanted if p != "fp32"]
    if extra_engines:
        rows += engine_rows(device)
    reference_model = _load(spec, "fp32", "torch", plan, sub_batch_tokens)
    try:
        reference, fp32_rate = _timed_embed(reference_model, texts)
    finally:
        reference_model.close()
    reports = [PrecisionReport("fp32", device, 1.0, 1.0, 1.0, fp32_rate, True)]
    for precision, engine in rows:
        reports.append(
            _measure(spec, plan, precision, engine, texts, reference, gate, sub_batch_tokens)
        )
    return reports


def layout_of(device: str) -> CpuPlan:
    """How a worker on this host lays the model out by default."""
    return plan_cpu(device, usable_cpus())


def _load(
    spec: ModelSpec, precision: str, engine: str, plan: CpuPlan, sub_batch_tokens: int | None
) -> Embedder:
    return Embedder.load(
        precision=precision,
        device=plan.device,
        sub_batch_tokens=sub_batch_tokens,
        replicas=plan.replicas,
        threads_per_replica=plan.threads_per_replica,
        spec=spec,
        engine=engine,
    )


def _measure(
    spec: ModelSpec,
    plan: CpuPlan,
    precision: str,
    engine: str,
    texts: list[str],
    reference: np.ndarray,
    gate: Gate,
    sub_batch_tokens: int | None,
) -> PrecisionReport:
    try:
        embedder = _load(spec, precision, engine, plan, sub_batch_tokens)
    except ModelError as exc:
        log.warning("precision %s on %s: not measured: %s", precision, engine, exc)
        return PrecisionReport(precision, plan.device, 0.0, 0.0, 0.0, 0.0, False, engine)
    try:
        vectors, rate = _timed_embed(embedder, texts)
    except ModelError as exc:
        log.warning("precision %s on %s: does not run here: %s", precision, engine, exc)
        return PrecisionReport(precision, plan.device, 0.0, 0.0, 0.0, 0.0, False, engine)
    finally:
        embedder.close()
    cos = cosine_rows(reference, vectors)
    recall = neighbour_recall(reference, vectors)
    passed = bool(cos.mean() >= gate.min_cosine_mean and recall >= gate.min_recall_at_10)
    return PrecisionReport(
        precision, plan.device, float(cos.mean()), float(cos.min()), recall, rate, passed, engine
    )


def _timed_embed(embedder: Embedder, texts: list[str]) -> tuple[np.ndarray, float]:
    # Warm-up on the whole sample: the first pass of each shape pays for allocation
    # and kernel choice (OpenVINO specialises its network per shape), which a
    # worker pays once and the comparison must not count.
    embedder.embed(texts)
    started = time.perf_counter()
    vectors = embedder.embed(texts)
    return vectors, len(texts) / (time.perf_counter() - started)


def choose(
    reports: list[PrecisionReport], allowed: tuple[str, ...] | None = None
) -> PrecisionReport:
    """The fastest selectable report that passed the gate (fp32 always passes), of
    the `allowed` precisions (None: any)."""
    passed = [
        r
        for r in reports
        if r.passed and r.selectable and (allowed is None or r.precision in allowed)
    ]
    if not passed:
        failed = ", ".join(_verdict(r) for r in reports if r.precision in (allowed or ()))
        raise ModelError(
            f"--precision auto: the output holds {'/'.join(allowed or ())} vectors and no "
            f"such precision passes the gate for this model here ({failed or 'none runs'}): "
            "name the precision to add to the output anyway, or give a new --output"
        )
    return max(passed, key=lambda r: r.texts_per_s)


# -- remembering the choice ------------------------------------------------------------


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "embedding-pipeline" / "precision.json"


def _spec(model: str | ModelSpec) -> ModelSpec:
    return ModelSpec.read(model) if isinstance(model, str) else model


def _identity(model: str | ModelSpec) -> str:
    # The whole stack's: the same weights under another head are another model.
    return _spec(model).identity


def _cache_key(model: str | ModelSpec, device: str, plan: CpuPlan | None) -> str:
    hardware = cpu_model() if device == "cpu" else _gpu_model()
    plan = plan or layout_of(device)
    # int8 made another way is measured again.
    layout = f"{plan.replicas}x{plan.threads_per_replica}"
    return f"{_identity(model)}|{device}|{hardware}|{layout}|{openvino_engine.RECIPE}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_model() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"


def remember(
    model: str | ModelSpec,
    device: str,
    gate: Gate,
    reports: list[PrecisionReport],
    plan: CpuPlan | None = None,
) -> None:
    path = cache_path()
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, json.JSONDecodeError):
        data = {}
    data[_cache_key(model, device, plan)] = {
        "choice": choose(reports).precision,
        "gate": asdict(gate),
        "reports": [asdict(r) for r in reports],
        "measured_at": time.time(),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError as exc:  # a cache: the next run measures again
        log.warning("could not remember the precision choice in %s: %s", path, exc)


def remembered(
    model: str | ModelSpec, device: str, gate: Gate, plan: CpuPlan | None = None
) -> list[PrecisionReport] | None:
    """The reports measured for this model, device and layout under this gate, where they
    cover every precision the device now offers (an engine installed since, or a
    release that adds one, measures again)."""
    path = cache_path()
    try:
        entry = json.loads(path.read_text()).get(_cache_key(model, device, plan))
        if not entry or entry.get("gate") != asdict(gate):
            return None
        reports = [PrecisionReport(**r) for r in entry["reports"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return None
    measured = {r.precision for r in reports if r.selectable}
    return reports if set(candidates_for(device)) <= measured else None


def resolve_precision(
    model: str | ModelSpec,
    device: str,
    requested: str,
    texts: Callable[[], list[str]],
    gate: Gate = DEFAULT_GATE,
    allowed: tuple[str, ...] | None = None,
    plan: CpuPlan | None = None,
) -> str:
    """A concrete precision for `requested` (which may be 'auto'). `texts` gives the
    sample to measure on: built only when a measurement is due (gathering the
    stdlib sample took seconds of the worker's start-up). `allowed`: the precisions
    auto may pick (an output's vectors admit only those of their kind). `plan`: the
    worker's layout, which each candidate is measured in (None: `layout_of`)."""
    if requested != "auto":
        return requested
    device = pick_device(device)
    reports = remembered(model, device, gate, plan)
    if reports is not None:
        best = choose(reports, allowed)
        log.info("precision auto: %s (remembered for this model and device)", best.precision)
        return best.precision
    sample = texts()
    log.info("precision auto: measuring candidates against fp32 on %d texts", len(sample))
    reports = check_precisions(model, device, sample, None, gate, plan=plan)
    remember(model, device, gate, reports, plan)
    best = choose(reports, allowed)
    log.info(
        "precision auto: %s on %s (cosine %.4f, recall@10 %.3f, %.0f texts/s; %s)",
        best.precision,
        best.engine,
        best.cosine_mean,
        best.recall_at_10,
        best.texts_per_s,
        ", ".join(_verdict(r) for r in reports),
    )
    return best.precision


def _verdict(report: PrecisionReport) -> str:
    verdict = "pass" if report.passed else "fail"
    return f"{report.precision} on {report.engine} {report.texts_per_s:.0f}/s {verdict}"
