"""The OpenVINO engine: the Transformer module's network converted to OpenVINO, at
fp32 or int8, run on the CPU.

int8 is OpenVINO's dynamic quantisation of the activations on weights NNCF compressed
to int8 (asymmetric, one scale per output channel): at every matmul the CPU plugin
quantises each token's activations in groups of the recipe's size, with scales of that
pass's own values, and multiplies in int8. No range is fixed at calibration, so no
corpus (Chinese, code, another domain) is clipped outside a calibration sample's range;
static int8 (NNCF, SmoothQuant, bias correction) was measured below the gate where
dynamic int8 stays above it (docs/performance.md: precisions).

Three recipes (`RECIPES`), each its own model identity:
- the smoothed ones smooth the network first (pipeline.model.smoothing: SmoothQuant's
  scales, measured on calibration text and folded exactly into the network), which
  lets a whole token's row share one scale. `SMOOTHED_DOWN` quantises the
  feed-forward down-projections too, all but the first layer's; `SMOOTHED` leaves
  them in floating point. The default (`RECIPE`) is SMOOTHED_DOWN where the model
  keeps a margin over the precision gate with it (pipeline.model.int8_margin,
  measured once at its conversion), else SMOOTHED (docs/performance.md: smoothing,
  and the down-projections);
- the first recipe, groups of 32 values and nothing smoothed, still made for the
  outputs that hold its vectors (an int8 output admits its own recipe's only).

The converted and compressed model is cached on disk (`cache_dir`), keyed by the model
identity, the recipe and the OpenVINO and NNCF releases: a new release converts
again. The pooling and the modules after it run in torch on the engine's hidden
states (pipeline.model.head), as for every engine.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import logging
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.errors import ModelError
from pipeline.model import int8_margin
from pipeline.model.engine_process import EngineProcesses, last_line
from pipeline.model.shapes import right_padded, sorted_batches
from pipeline.model.spec import ModelSpec

log = logging.getLogger(__name__)

ENGINE = "openvino"


@dataclass(frozen=True)
class Recipe:
    """How int8 is made. `name` is what the outputs record (ModelInfo.calibration): the
    identity of a quantised output, so a recipe's name never changes."""

    name: str
    group: int  # activations quantised in groups of this many values of a token
    smoothed: bool  # SmoothQuant's scales folded in
    # Smoothed only: the down-projections but the first layer's quantised (else float).
    int8_down: bool = False


# Measured on MiniLM (docs/performance.md): unsmoothed, groups of 32 kept recall@10
# 0.975 against fp32 where a whole row kept 0.946.
FIRST = Recipe("nncf-int8-asym-per-channel-weights+dynamic-int8-activations-g32", 32, False)
# Smoothed, a row of 384 values shares one scale at about the first recipe's recall,
# and runs faster (docs/performance.md: smoothing).
_SMOOTHED = (
    "smoothquant-a0.7-stdlib300+nncf-int8-asym-per-channel-weights+dynamic-int8-activations-g384"
)
SMOOTHED = Recipe(f"{_SMOOTHED}+float-down-projections", 384, True)
# The first layer's down-projection is the one that costs most recall in int8.
SMOOTHED_DOWN = Recipe(f"{_SMOOTHED}+int8-down-projections-but-the-first", 384, True, True)
RECIPES = {recipe.name: recipe for recipe in (SMOOTHED_DOWN, SMOOTHED, FIRST)}
# What int8 is made with, unless an output holds another: SMOOTHED_DOWN where the model
# keeps the margin with it, else SMOOTHED (`default_recipe`). Outputs record which.
RECIPE = f"{_SMOOTHED}+int8-down-projections-where-the-margin-holds"
CALIBRATION_TEXTS = 300
_CALIBRATION_BATCH = 16

_XML = "model.xml"
# A forward pass that takes longer is stuck, not slow (the longest measured: seconds).
PASS_TIMEOUT_S = 300
# The conversion check: two texts of other lengths than the trace's, one padded.
_PROBE = (
    "an OpenVINO conversion probe",
    "a longer probe of the conversion, so that the first text is padded beside it, " * 3,
)
_CONVERSION_MIN_COSINE = 0.9999
_CONVERT_LOCK = threading.Lock()


def available() -> bool:
    """Whether OpenVINO and NNCF are installed."""
    _telemetry_by_consent_only()
    try:
        import nncf  # noqa: F401
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _telemetry_by_consent_only() -> None:
    """OpenVINO's converter and NNCF send usage telemetry when no consent file says
    otherwise (openvino_telemetry reads a missing file as consent where the tool asks
    no question). A worker sends nothing nobody agreed to: a missing file reads as
    declined; `opt_in_out --opt_in` still turns it on. Before NNCF's import, which
    decides then."""
    try:
        from openvino_telemetry.utils import opt_in_checker
    except ImportError:
        return
    result, checker = opt_in_checker.ConsentCheckResult, opt_in_checker.OptInChecker
    asked = checker.check

    def check(self: Any, *args: Any, **kwargs: Any) -> Any:
        found = asked(self, *args, **kwargs)
        return result.DECLINED if found == result.NO_FILE else found

    checker.check = check


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "embedding-pipeline" / "openvino"


class OpenVinoNetwork:
    """The network as OpenVINO runs it: hidden states of right-padded rows.

    Compiled for one replica (or for OpenVINO's own layout, every core), it runs in
    this process: one stream, one infer request. Compiled for several single- or
    few-threaded replicas, each replica is a process of its own
    (pipeline.model.engine_process), so that no runtime ever runs two requests at
    once: requests of their own in one runtime that met a new pass shape at once
    specialised it concurrently, which on a loaded 2-core machine twice never
    finished (as OpenVINO's users found: ultralytics issue 25923)."""

    def __init__(
        self, model: Any, config: Any, precision: str, xml: Path, recipe: Recipe | None = None
    ) -> None:
        self.ov_model = model
        self.config = config  # the network's, for pass sizing (activation_bytes_per_token)
        self.precision = precision
        self.recipe = recipe  # int8's (None for fp32)
        self.xml = xml  # the cached model, which replica processes read
        self._compiled: Any = None
        self._request: Any = None
        self._turn = threading.Lock()

    def compile(
        self, replicas: int, threads_per_replica: int | None
    ) -> OpenVinoNetwork | OpenVinoReplicas:
        """A copy compiled for this layout (the model itself is shared): in this
        process for one replica, else a process per replica."""
        import openvino as ov

        if replicas > 1 and threads_per_replica is not None:
            properties = self._properties(threads_per_replica)
            # Each process its own stream on cores the OS gives it: pinned, every
            # process's one thread went to the same core.
            properties["ENABLE_CPU_PINNING"] = False
            processes = EngineProcesses(str(self.xml), properties, replicas, PASS_TIMEOUT_S)
            return OpenVinoReplicas(self, processes)
        threads = None if threads_per_replica is None else replicas * threads_per_replica
        compiled = OpenVinoNetwork(
            self.ov_model, self.config, self.precision, self.xml, self.recipe
        )
        compiled._compiled = ov.Core().compile_model(
            self.ov_model, "CPU", self._properties(threads)
        )
        compiled._request = compiled._compiled.create_infer_request()
        return compiled

    def _properties(self, threads: int | None) -> dict[str, Any]:
        """One stream of `threads` threads (None: OpenVINO's own, every core, as torch)."""
        properties: dict[str, Any] = {"NUM_STREAMS": "1"}
        if threads is not None:
            properties["INFERENCE_NUM_THREADS"] = str(threads)
        if self.recipe is not None:
            # The operations left in floating point (attention's products, softmax,
            # normalisation) at OpenVINO's default: bf16 where the CPU has it natively
            # (10 % faster on MiniLM, recall@10 0.973 against 0.975), else fp32. The
            # gate measures int8 as it runs.
            properties["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = str(self.recipe.group)
        else:
            properties["INFERENCE_PRECISION_HINT"] = "f32"  # fp32 means fp32 here
        return properties

    @contextlib.contextmanager
    def hidden(self, input_ids: np.ndarray, mask: np.ndarray) -> Iterator[Any]:
        """The last hidden state (a torch tensor) of int64 ids and mask, valid inside
        the block: the request's output, which no other pass reuses until it ends."""
        import torch

        if self._request is None:
            raise RuntimeError("OpenVinoNetwork.compile() before hidden()")
        if not self._turn.acquire(timeout=PASS_TIMEOUT_S):
            raise self._stuck(input_ids.shape)
        try:
            try:
                self._request.start_async({"input_ids": input_ids, "attention_mask": mask})
                finished = self._request.wait_for(PASS_TIMEOUT_S * 1000)
            except RuntimeError as exc:  # the CPU lacks a kernel it needs (ONEDNN_MAX_CPU_ISA)
                raise ModelError(f"OpenVINO cannot run this model here: {last_line(exc)}") from exc
            if not finished:
                self._request.cancel()
                raise self._stuck(input_ids.shape)
            yield torch.from_numpy(self._request.get_output_tensor(0).data)
        finally:
            self._turn.release()

    def cpu_seconds(self) -> float:
        """CPU seconds of processes of its own: none (it runs in this one)."""
        return 0.0

    def close(self) -> None:
        """Nothing to end: the request goes with the object."""

    @staticmethod
    def _stuck(shape: tuple[int, ...]) -> ModelError:
        return ModelError(
            f"an OpenVINO pass of {shape[0]} x {shape[1]} tokens did not finish in "
            f"{PASS_TIMEOUT_S} s: the engine is stuck (nothing of this batch was written "
            "or committed)"
        )


class OpenVinoReplicas:
    """The network compiled into a process per replica (pipeline.model.engine_process):
    the same calls as a compiled OpenVinoNetwork."""

    def __init__(self, network: OpenVinoNetwork, processes: EngineProcesses) -> None:
        self._network = network
        self._processes = processes
        self.config = network.config
        self.precision = network.precision

    def compile(
        self, replicas: int, threads_per_replica: int | None
    ) -> OpenVinoNetwork | OpenVinoReplicas:
        return self._network.compile(replicas, threads_per_replica)

    @contextlib.contextmanager
    def hidden(self, input_ids: np.ndarray, mask: np.ndarray) -> Iterator[Any]:
        import torch

        with self._processes.hidden(input_ids, mask) as states:
            yield torch.from_numpy(states)

    def cpu_seconds(self) -> float:
        return self._processes.cpu_seconds()

    def close(self) -> None:
        self._processes.close()


def recipe_named(name: str) -> Recipe:
    """The int8 recipe an output records, or a ModelError naming the ones made here."""
    if name == RECIPE:
        raise ModelError(f"{RECIPE!r} chooses a recipe (default_recipe); it is none itself")
    if name not in RECIPES:
        raise ModelError(f"no int8 recipe {name!r} in this release (it makes {', '.join(RECIPES)})")
    return RECIPES[name]


def load(
    spec: ModelSpec, net: Any, native: bool, precision: str, recipe: str = RECIPE
) -> OpenVinoNetwork:
    """The torch network `net` on OpenVINO at `precision` (fp32 or int8, made with
    `recipe`), from the cache or converted (and compressed) now and cached."""
    if precision not in ("fp32", "int8"):
        raise ModelError(f"the OpenVINO engine runs fp32 and int8, not {precision}")
    if not available():
        raise ModelError(
            f"--precision {precision} on OpenVINO needs the openvino and nncf packages "
            "(pip install embedding-pipeline, which depends on them)"
        )
    import openvino as ov

    made = None
    if precision == "int8":
        made = default_recipe(spec, net, native) if recipe == RECIPE else recipe_named(recipe)
    folder = cache_dir() / _cache_key(spec, native, precision, made)
    with _CONVERT_LOCK:
        model = _read_cached(folder)
        if model is None:
            _convert(spec, net, native, made, folder)
            model = ov.Core().read_model(str(folder / _XML))
    config = getattr(net, "config", None)
    return OpenVinoNetwork(model, config, precision, folder / _XML, made)


def default_recipe(spec: ModelSpec, net: Any, native: bool) -> Recipe:
    """SMOOTHED_DOWN where this model keeps the margin over the gate with it, else
    SMOOTHED: measured when SMOOTHED_DOWN is converted, and kept beside its model."""
    folder = cache_dir() / _cache_key(spec, native, "int8", SMOOTHED_DOWN)
    with _CONVERT_LOCK:
        # The verdict is written before the folder is renamed into place: where it is,
        # the conversion finished (a damaged model is converted again by `load`, when
        # it is the one chosen).
        verdict = int8_margin.read(folder)
        if verdict is None:  # not converted yet, or measured on another sample
            shutil.rmtree(folder, ignore_errors=True)
            _convert(spec, net, native, SMOOTHED_DOWN, folder)
            verdict = int8_margin.read(folder)
    if verdict is None:
        raise ModelError(f"OpenVINO: no margin measurement in {folder} after converting")
    log.info("OpenVINO int8: %s", verdict.describe())
    return SMOOTHED_DOWN if verdict.holds else SMOOTHED


def _read_cached(folder: Path) -> Any:
    """The cached model, or None: absent, or damaged (then removed, to convert again)."""
    import openvino as ov

    xml = folder / _XML
    if not xml.exists():
        return None
    try:
        return ov.Core().read_model(str(xml))
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unreadable"
        log.warning("OpenVINO: the cached model %s is damaged (%s): converting again", xml, first)
        shutil.rmtree(folder, ignore_errors=True)
        return None


def _cache_key(spec: ModelSpec, native: bool, precision: str, recipe: Recipe | None) -> str:
    import nncf
    import openvino as ov

    parts = [
        spec.identity,
        "native" if native else "transformers",
        precision,
        recipe.name if recipe is not None else "",
        ov.__version__,
        nncf.__version__,
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def _convert(spec: ModelSpec, net: Any, native: bool, recipe: Recipe | None, folder: Path) -> None:
    """Converts (and for an int8 recipe smooths and compresses) `net` into `folder`,
    atomically: a worker beside this one sees the whole model or none."""
    import openvino as ov

    started = time.perf_counter()
    with _smoothed(spec, net, native, recipe) as ready:
        model = _converted(ready, native)
        _check_conversion(spec, ready, native, model)
    if recipe is not None:
        model = _compressed(model, recipe)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    try:
        if recipe is not None and recipe.int8_down:
            compiled = OpenVinoNetwork(model, None, "int8", staging / _XML, recipe)
            verdict = int8_margin.measure(
                spec, net, native, compiled.compile(1, None), CALIBRATION_TEXTS
            )
            verdict.write(staging)
        # compress_to_fp16 False: the fp32 constants stay fp32 (the default halves them).
        ov.save_model(model, str(staging / _XML), compress_to_fp16=False)
        try:
            staging.rename(folder)
        except OSError:
            if not (folder / _XML).exists():
                raise
            # Another process converted it meanwhile: theirs is the same model.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info(
        "OpenVINO: %s model converted in %.1fs, cached in %s",
        recipe.name if recipe is not None else "fp32",
        time.perf_counter() - started,
        folder,
    )


@contextlib.contextmanager
def _smoothed(spec: ModelSpec, net: Any, native: bool, recipe: Recipe | None) -> Iterator[Any]:
    """`net`, smoothed where the recipe says (pipeline.model.smoothing), for the time of
    the block: calibrated on stdlib paragraphs apart from those the gate judges, in
    length-sorted passes whose padding the ranges leave out."""
    if recipe is None or not recipe.smoothed:
        yield net
        return
    import torch

    from pipeline.core.corpus import calibration_texts
    from pipeline.model import network, smoothing

    tokenizer = spec.tokenizer.backend(spec.max_length)
    rows = [e.ids for e in tokenizer.encode_batch(calibration_texts(CALIBRATION_TEXTS))]
    pad = spec.tokenizer.pad_token_id or 0

    def batches() -> Iterator[tuple[Any, Any]]:
        for ids, mask in sorted_batches(rows, pad, _CALIBRATION_BATCH):
            yield torch.from_numpy(ids), torch.from_numpy(mask)

    def forward(ids: Any, mask: Any) -> Any:
        return network.forward(net, native, ids, mask)

    ranges = smoothing.input_ranges(net, forward, batches())
    with smoothing.smoothed(net, ranges) as ready:
        yield ready


def _converted(net: Any, native: bool) -> Any:
    import openvino as ov
    import torch

    from pipeline.model import network

    class Traced(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return network.forward(self.net, native, input_ids, attention_mask)

    # Traced on a padded batch: the mask's paths are in the graph.
    example = torch.ones(2, 16, dtype=torch.long)
    mask = example.clone()
    mask[1, 9:] = 0
    try:
        # The converter traces with torch.jit, which warns that it is deprecated.
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            # ... and warns of every Python branch it fixes: _check_conversion measures
            # whether the graph holds for other shapes and padding.
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            return ov.convert_model(
                Traced().eval(),
                example_input=(example, mask),
                input=[
                    ("input_ids", [-1, -1], ov.Type.i64),
                    ("attention_mask", [-1, -1], ov.Type.i64),
                ],
            )
    except Exception as exc:  # the converter raises many kinds; one line names it
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"OpenVINO could not convert this model: {first}") from exc


def _check_conversion(spec: ModelSpec, net: Any, native: bool, model: Any) -> None:
    """Refuses a conversion whose hidden states differ from torch's on a batch of
    another shape than the traced one, padded (a branch the trace fixed, a position
    computed once): the engine must compute the network's function."""
    import openvino as ov
    import torch

    from pipeline.model import network

    tokenizer = spec.tokenizer.backend(spec.max_length)
    rows = [e.ids for e in tokenizer.encode_batch(list(_PROBE))]
    ids, mask = right_padded(rows, spec.tokenizer.pad_token_id or 0)
    with torch.inference_mode():
        expected = network.forward(net, native, torch.from_numpy(ids), torch.from_numpy(mask))
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    got = torch.from_numpy(compiled({"input_ids": ids, "attention_mask": mask})[0])
    real = torch.from_numpy(mask).bool()
    cosine = torch.nn.functional.cosine_similarity(
        got[real].float(), expected[real].float(), dim=-1
    ).min()
    if float(cosine) < _CONVERSION_MIN_COSINE:
        raise ModelError(
            f"OpenVINO's conversion of this model differs from torch on a padded batch "
            f"(token cosine {float(cosine):.5f}): it runs on torch only (fp32, bf16)"
        )


def _down_projections(model: Any) -> list[str]:
    """The names of the matmuls whose constant weights read more values than they
    write (not pipeline.model.smoothing.smoothable), in the order the network runs them."""
    names = []
    for op in model.get_ordered_ops():
        if op.get_type_name() != "MatMul" or op.input_value(1).get_node().get_type_name() != (
            "Constant"
        ):
            continue
        shape = op.get_input_partial_shape(1)
        if not shape.is_static or len(shape) != 2:
            continue
        rows, columns = shape.to_shape()
        into, out = (columns, rows) if op.get_attributes()["transpose_b"] else (rows, columns)
        if into > out:
            names.append(op.get_friendly_name())
    return names


def _compressed(model: Any, recipe: Recipe) -> Any:
    import nncf

    # NNCF reports its statistics as tables at INFO and draws a progress bar on
    # stdout (where `pipeline model check --json` writes): one log line of ours says it.
    nncf_log = logging.getLogger("nncf")
    level = nncf_log.level
    nncf_log.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            ignored = _float_layers(model, recipe)
            return nncf.compress_weights(
                model,
                mode=nncf.CompressWeightsMode.INT8_ASYM,
                ignored_scope=nncf.IgnoredScope(names=ignored),
            )
    finally:
        nncf_log.setLevel(level)


def _float_layers(model: Any, recipe: Recipe) -> list[str]:
    """The matmuls a recipe leaves in floating point: a smoothed recipe's down-
    projections (all, or the first layer's only)."""
    if not recipe.smoothed:
        return []
    downs = _down_projections(model)
    return downs[:1] if recipe.int8_down else downs
