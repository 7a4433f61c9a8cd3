"""The peers a user could pick instead of the pipeline, each with its gate figures:
sentence-transformers in torch at fp32 and bf16, and the engines its ONNX and
OpenVINO backends run, at fp32 and at the int8 its export helpers make.

sentence-transformers' ONNX and OpenVINO backends go through optimum, which does not
install beside this project's transformers; so each engine peer runs here as those
backends run it: the Hugging Face model exported (torch.onnx) or converted
(openvino.convert_model), texts sorted by length and encoded in batches of 32 padded
to their longest, the model's own pooling and normalisation after it (the module
stack sentence-transformers reads: pipeline.model.head), rows restored to input order.
int8 as its helpers make it: ONNX Runtime's dynamic quantisation
(`export_dynamic_quantized_onnx_model`), NNCF's static quantisation with 300
calibration texts (`export_static_quantized_openvino_model`, which quantises as a
transformer: SmoothQuant, fast bias correction).

Every peer is measured on the benchmark's texts after a warm-up, with the threads the
bench gives (b); its vectors are compared with sentence-transformers' fp32 ones
(cosine mean and minimum, neighbour recall@10) against the precision gate. Each comes
with a `Timer` that times it again with its model still loaded: the bench re-times the
contenders for "best" in every round, beside (a) and (d), and takes their medians.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from harness.baselines import ST_BATCH, WARMUP_TEXTS
from harness.numbers import Rate, Timer, median_by
from pipeline.model.precision import DEFAULT_MIN_COSINE, DEFAULT_MIN_RECALL, cosine_rows
from pipeline.model.precision import neighbour_recall as recall_at_10
from pipeline.model.spec import ModelSpec

CALIBRATION_TEXTS = 300
# Passing peers this close to the fastest are timed again each round: a single timing
# on a drifting machine does not tell which of two near peers is the faster.
CONTENDER_SHARE = 0.85
# hidden states of (ids, mask), both int64 arrays
Infer = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Peer:
    rate: Rate  # the median of `rounds` where it was timed again
    cosine_mean: float
    cosine_min: float
    recall_at_10: float
    rounds: tuple[float, ...] = ()  # texts/s of each round's timing

    @property
    def passed(self) -> bool:
        return self.cosine_mean >= DEFAULT_MIN_COSINE and self.recall_at_10 >= DEFAULT_MIN_RECALL


def judged(rate: Rate, vectors: np.ndarray, reference: np.ndarray) -> Peer:
    cos = cosine_rows(reference, vectors)
    return Peer(rate, float(cos.mean()), float(cos.min()), recall_at_10(reference, vectors))


def first_timing(timer: Timer, reference: np.ndarray) -> tuple[Peer, Timer]:
    """The peer's first timing, with its vectors' gate figures; its Timer for the rounds."""
    rate, vectors = timer.timed()
    return judged(rate, np.asarray(vectors, dtype=np.float32), reference), timer


def reference_peer(rate: Rate) -> Peer:
    """sentence-transformers fp32: the reference itself."""
    return Peer(rate, 1.0, 1.0, 1.0)


def st_bf16(model_dir: Path, texts: list[str], reference: np.ndarray) -> tuple[Peer, Timer]:
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu").to(torch.bfloat16)
    model.encode(texts[:WARMUP_TEXTS], batch_size=ST_BATCH, show_progress_bar=False)

    def encode() -> object:
        return model.encode(texts, batch_size=ST_BATCH, show_progress_bar=False)

    timer = Timer("st-bf16", "sentence-transformers torch bf16", len(texts), encode)
    return first_timing(timer, reference)


class Encoder:
    """sentence-transformers' encode around an engine's forward pass."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        from pipeline.model.head import Head

        self.spec = ModelSpec.read(str(model_dir))
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.head = Head(self.spec.stack, self.spec.truncate_dim)

    def encode(self, infer: Infer, texts: list[str]) -> np.ndarray:
        import torch

        order = np.argsort([-len(t) for t in texts], kind="stable")
        out = np.empty((len(texts), self.spec.dim), dtype=np.float32)
        for start in range(0, len(texts), ST_BATCH):
            rows = order[start : start + ST_BATCH]
            batch = self.tokenizer(
                [texts[i] for i in rows],
                padding=True,
                truncation=True,
                max_length=self.spec.max_length,
                return_tensors="np",
            )
            ids = batch["input_ids"].astype(np.int64)
            mask = batch["attention_mask"].astype(np.int64)
            hidden = torch.from_numpy(np.ascontiguousarray(infer(ids, mask), dtype=np.float32))
            with torch.inference_mode():
                out[rows] = self.head(hidden, torch.from_numpy(mask), 0).numpy()
        return out

    def timed(
        self, key: str, name: str, infer: Infer, texts: list[str], reference: np.ndarray
    ) -> tuple[Peer, Timer]:
        self.encode(infer, texts[:WARMUP_TEXTS])
        return first_timing(
            Timer(key, name, len(texts), lambda: self.encode(infer, texts)), reference
        )

    def batches(self, texts: list[str]) -> list[dict[str, np.ndarray]]:
        """Calibration inputs, one text each (as optimum feeds NNCF)."""
        out = []
        for text in texts:
            batch = self.tokenizer(
                [text], truncation=True, max_length=self.spec.max_length, return_tensors="np"
            )
            out.append({k: batch[k].astype(np.int64) for k in ("input_ids", "attention_mask")})
        return out


def _hf_model(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModel

    class LastHidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = AutoModel.from_pretrained(str(model_dir), use_safetensors=True).eval()

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.net(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    return LastHidden().eval()


# -- ONNX Runtime ----------------------------------------------------------------------


def onnx_peers(
    model_dir: Path, texts: list[str], reference: np.ndarray, workdir: Path, threads: int
) -> list[tuple[Peer, Timer]]:
    import onnxruntime as ort
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    encoder = Encoder(model_dir)
    fp32_path, int8_path = workdir / "model.onnx", workdir / "model-int8.onnx"
    example = torch.ones(2, 16, dtype=torch.long)
    with torch.no_grad():
        torch.onnx.export(
            _hf_model(model_dir),
            (example, example),
            str(fp32_path),
            input_names=["input_ids", "attention_mask"],
            output_names=["last_hidden_state"],
            dynamic_axes={
                "input_ids": {0: "batch", 1: "sequence"},
                "attention_mask": {0: "batch", 1: "sequence"},
                "last_hidden_state": {0: "batch", 1: "sequence"},
            },
            opset_version=17,
            dynamo=False,
        )
    quantize_dynamic(str(fp32_path), str(int8_path), weight_type=QuantType.QInt8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    peers = []
    for key, name, path in (
        ("onnx-fp32", "ONNX Runtime fp32", fp32_path),
        ("onnx-int8", "ONNX Runtime int8, dynamic (quantize_dynamic)", int8_path),
    ):
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

        def infer(ids: np.ndarray, mask: np.ndarray, session: Any = session) -> np.ndarray:
            return session.run(None, {"input_ids": ids, "attention_mask": mask})[0]

        peers.append(encoder.timed(key, name, infer, texts, reference))
    return peers


# -- OpenVINO --------------------------------------------------------------------------


def openvino_peers(
    model_dir: Path,
    texts: list[str],
    reference: np.ndarray,
    calibration: list[str],
    threads: int,
) -> list[tuple[Peer, Timer]]:
    import torch

    from pipeline.model import openvino_engine

    openvino_engine.available()  # telemetry only by consent, before NNCF's import
    import nncf
    import openvino as ov

    encoder = Encoder(model_dir)
    example = torch.ones(2, 16, dtype=torch.long)
    with torch.no_grad():
        fp32 = ov.convert_model(
            _hf_model(model_dir),
            example_input=(example, example),
            input=[("input_ids", [-1, -1], ov.Type.i64), ("attention_mask", [-1, -1], ov.Type.i64)],
        )
    with contextlib.redirect_stdout(sys.stderr):  # NNCF's progress bars: not the report
        int8 = nncf.quantize(
            fp32.clone(),
            nncf.Dataset(encoder.batches(calibration)),
            subset_size=len(calibration),
            model_type=nncf.ModelType.TRANSFORMER,
        )
    config = {
        "INFERENCE_PRECISION_HINT": "f32",
        "INFERENCE_NUM_THREADS": str(threads),
        "PERFORMANCE_HINT": "LATENCY",
    }
    peers = []
    for key, name, model in (
        ("openvino-fp32", "OpenVINO fp32", fp32),
        (
            "openvino-int8",
            f"OpenVINO int8, static (NNCF, {len(calibration)} calibration texts)",
            int8,
        ),
    ):
        request = ov.Core().compile_model(model, "CPU", config).create_infer_request()

        def infer(ids: np.ndarray, mask: np.ndarray, request: Any = request) -> np.ndarray:
            request.infer({"input_ids": ids, "attention_mask": mask})
            return request.get_output_tensor(0).data.copy()

        peers.append(encoder.timed(key, name, infer, texts, reference))
    return peers


# -- all of them, and the table -----------------------------------------------------------


def measure_peers(
    model_dir: Path,
    texts: list[str],
    reference: np.ndarray,
    workdir: Path,
    threads: int,
    say: Callable[[str], None],
) -> list[tuple[Peer, Timer]]:
    """The peers beside sentence-transformers fp32, each on a fresh thread as it runs."""
    from pipeline.core.corpus import sample_texts
    from pipeline.core.host import call_on_fresh_thread

    # Calibration text the benchmark's records do not hold (pipeline.core.corpus has
    # thousands of paragraphs; past its end, the records' own start, as a user might).
    pool = sample_texts(len(texts) + CALIBRATION_TEXTS)
    calibration = pool[len(texts) :] or pool[:CALIBRATION_TEXTS]
    say("peers: sentence-transformers bf16")
    peers = [call_on_fresh_thread(lambda: st_bf16(model_dir, texts, reference))]
    say("peers: ONNX Runtime fp32 and int8")
    onnx_dir = workdir / "onnx"
    onnx_dir.mkdir()
    peers += call_on_fresh_thread(
        lambda: onnx_peers(model_dir, texts, reference, onnx_dir, threads)
    )
    say("peers: OpenVINO fp32 and static int8")
    peers += call_on_fresh_thread(
        lambda: openvino_peers(model_dir, texts, reference, calibration, threads)
    )
    return peers


def best(peers: list[Peer]) -> Peer:
    """The fastest peer that passes the gate."""
    return max((p for p in peers if p.passed), key=lambda p: p.rate.per_s)


def contenders(measured: list[tuple[Peer, Timer]]) -> list[tuple[Peer, Timer]]:
    """The peers that could be "best": passing, and within CONTENDER_SHARE of the
    fastest that passes."""
    fastest = best([peer for peer, _ in measured]).rate.per_s
    return [
        (peer, timer)
        for peer, timer in measured
        if peer.passed and peer.rate.per_s >= CONTENDER_SHARE * fastest
    ]


def at_median(peer: Peer, rates: list[Rate]) -> Peer:
    """`peer` at the median of its rounds' timings (its first timing judged the gate)."""
    if not rates:
        return peer
    return replace(
        peer, rate=median_by(rates, lambda r: r.per_s), rounds=tuple(r.per_s for r in rates)
    )


def render_peers(peers: list[Peer]) -> list[str]:
    fastest = best(peers)
    lines = [
        "peers against (b)'s fp32 vectors (gate: cosine mean >= "
        f"{DEFAULT_MIN_COSINE}, recall@10 >= {DEFAULT_MIN_RECALL}):",
        f"  {'peer':<56}{'texts/s':>9}{'cos mean':>10}{'cos min':>9}{'recall':>8}  gate",
    ]
    for p in peers:
        mark = "  <- best" if p is fastest else ""
        lines.append(
            f"  {p.rate.name:<56}{p.rate.per_s:>9.1f}{p.cosine_mean:>10.5f}"
            f"{p.cosine_min:>9.4f}{p.recall_at_10:>8.3f}  {'pass' if p.passed else 'FAIL'}{mark}"
        )
    for p in peers:
        if p.rounds:
            values = ", ".join(f"{v:.1f}" for v in p.rounds)
            lines.append(f"  {p.rate.name} in {len(p.rounds)} rounds: {values} (median above)")
    return lines
