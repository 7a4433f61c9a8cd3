"""The worker's process: what is set up around the poll loop before it runs.

One malloc arena (before any thread starts), the model's thread plan, the cluster
checked and the model's identity checked against the output (both in seconds,
before any weights load), the signal handlers (one shutdown event: a first signal
drains, a second stops at once), the metrics server, and the model loading on a
thread of its own while the worker checks the cluster and its outputs.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from typing import Any

from consumers.summary import RunSummary
from consumers.worker import run_worker
from pipeline.core.config import WorkerConfig
from pipeline.core.corpus import sample_texts
from pipeline.core.host import (
    CpuPlan,
    plan_cpu,
    start_on_fresh_thread,
    usable_cpus,
    use_one_malloc_arena,
)
from pipeline.core.layout import describe
from pipeline.core.metrics import WorkerMetrics
from pipeline.kafka import cluster
from pipeline.model.embedder import Embedder, calibration_of, engine_for, pick_device
from pipeline.model.openvino_engine import RECIPES
from pipeline.model.precision import resolve_precision
from pipeline.model.spec import ModelSpec
from sinks.identity import (
    check_recorded_model,
    int8_recipe_held,
    precision_held,
    precisions_of_kind,
    recorded_model,
)

log = logging.getLogger(__name__)


def run(config: WorkerConfig) -> RunSummary:
    """Runs a worker process to its end (bulk mode), a signal, or an error."""
    # Tokenizing overlaps the model's forward passes on other threads; a parallel
    # tokenizer would only contend with them for the same cores (it was slower).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Before any other thread starts: free memory goes back to the OS in full after
    # each batch, and a backlog's passes do not leave it behind (pipeline.core.host).
    # Not where CUDA may serve: there up to eight tokenizer threads allocate at
    # once, and one arena's lock would serialise them (not measured on a GPU host).
    if config.model.device == "cpu" or (config.model.device == "auto" and not _nvidia_present()):
        use_one_malloc_arena()
    log.info("configuration: %s", json.dumps(config.redacted(), sort_keys=True))
    # First: a stop asked for during the seconds of start-up is a clean stop, not a
    # death by SIGTERM (a worker stopped 3 s after its start exited -15).
    shutdown = threading.Event()
    _install_signal_handlers(shutdown)
    _check_cluster(config)  # fail fast, before the seconds a model load takes
    # What the model is, from its files, and whether the output holds another one's
    # vectors: refused in seconds, before any weights load.
    spec, allowed, recipe = _model_spec(config)
    # The model (torch's import included) loads while the worker checks the
    # cluster and its outputs; the worker waits for it before the first write.
    model = start_on_fresh_thread(
        lambda: _load_model(config, spec, allowed, recipe, _plan_cpu(config)), "model-load"
    )
    metrics = WorkerMetrics()
    if config.metrics_port is not None:
        metrics.serve(config.metrics_port)
        log.info("metrics on http://0.0.0.0:%d/metrics", config.metrics_port)
    try:
        summary = run_worker(config, model, shutdown, metrics)
    finally:
        if model.done() and model.exception() is None:
            model.result().close()
    return summary


def _nvidia_present() -> bool:
    """Whether an NVIDIA driver is loaded, without importing torch (seconds)."""
    return os.path.exists("/dev/nvidiactl")


def _model_spec(
    config: WorkerConfig,
) -> tuple[ModelSpec, tuple[str, ...] | None, str | None]:
    """The model read from its files and checked against the output's vectors; the
    precisions `--precision auto` may pick for that output (None: any); and the int8
    recipe its int8 vectors were made with, where this release makes it (None: the
    default; an output made with another is refused)."""
    spec = ModelSpec.read(
        config.model.name,
        config.model.document_prompt,
        config.model.query_prompt,
        config.model.dimensions,
    )
    recorded = recorded_model(config.output)  # one read of the output (a LIST on S3)
    precision, allowed = config.model.precision, None
    if precision == "auto":
        # An output holds one kind (int8 or float): auto follows the one it holds,
        # checked here as the precision it records (auto resolves at load).
        held = precision_held(recorded)
        allowed = None if held is None else precisions_of_kind(held)
        precision = held or "fp32"
    engine = engine_for(precision)
    held_recipe = int8_recipe_held(recorded)
    recipe = held_recipe if held_recipe in RECIPES else None
    calibration = calibration_of(precision, engine, recipe)
    info = spec.info(precision, config.model.device, engine, calibration)
    check_recorded_model(recorded, info, describe(config.output))
    return spec, allowed, recipe


def _load_model(
    config: WorkerConfig,
    spec: ModelSpec,
    allowed: tuple[str, ...] | None,
    recipe: str | None,
    plan: CpuPlan,
) -> Embedder:
    precision = config.model.precision
    if precision == "auto":
        precision = resolve_precision(
            spec, config.model.device, "auto", lambda: sample_texts(256), allowed=allowed, plan=plan
        )
    return Embedder.load_planned(
        config.model.name,
        precision,
        plan,
        config.model.sub_batch_tokens,
        config.model.shapes == "exact",
        spec=spec,
        recipe=recipe,
    )


def _check_cluster(config: WorkerConfig) -> None:
    with cluster.admin_client(config.kafka) as admin:
        cluster.partitions_of(admin, config.kafka, config.topics)


def _plan_cpu(config: WorkerConfig) -> CpuPlan:
    import torch

    cpus = usable_cpus()
    plan = plan_cpu(
        pick_device(config.model.device), cpus, config.model.replicas, config.model.torch_threads
    )
    torch.set_num_threads(plan.threads_per_replica)
    log.info("model threads: %s (%d usable CPUs)", plan, cpus)
    return plan


def _install_signal_handlers(shutdown: threading.Event) -> None:
    def handler(signum: int, _frame: Any) -> None:
        if shutdown.is_set():
            raise KeyboardInterrupt  # a second signal: stop now, outputs stay consistent
        log.info("%s received: finishing the batches in flight", signal.Signals(signum).name)
        shutdown.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
