#!/usr/bin/env python3
"""The embedding path alone on a CUDA GPU: speed, utilisation and quality, in minutes.

Needs torch, transformers and numpy (faiss optional); no Kafka, no Java, no network.
For each precision (bf16, fp16): texts/s and tokens/s over a stream of micro-batches
of real prose (the first batch is a warm-up and not timed), exact pass shapes
against bucketed ones (pipeline.shapes), and model FLOP utilisation: the model's
FLOPs per computed token (2 x its non-embedding weights, plus attention's 4 x width
x hidden per layer) times computed tokens per second, over the GPU's dense peak at
that precision. Then the quality gate against fp32 on the same GPU (pipeline.precision),
and FAISS on the GPU against the CPU when faiss-gpu is installed.

    scripts/gpu-check.sh [--model DIR] [--texts 20000] [--batch-size 4096]
        [--precisions bf16,fp16] [--peak-tflops N] [--json FILE] [--device cuda]

`--device cpu` runs the same steps on the CPU (fp32 only; MFU left out): a check
of the script itself where no GPU is at hand.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from pipeline.corpus import sample_texts  # noqa: E402
from pipeline.embedder import Embedder  # noqa: E402
from pipeline.precision import Gate, check_precisions, cpu_model  # noqa: E402

# Dense tensor-core peaks in TFLOP/s (bf16 = fp16 on these parts), by name fragment.
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 PCIe": 756.0,
    "H100": 756.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A10G": 125.0,
    "A10": 125.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "V100": 125.0,
    "T4": 65.0,
}


def peak_tflops(name: str) -> float | None:
    for fragment, peak in PEAK_TFLOPS.items():  # longer names first in the table
        if fragment in name:
            return peak
    return None


def flops_per_token(embedder: Embedder, width: float) -> float:
    """Forward FLOPs per computed token: weights (not embeddings) and attention."""
    net = embedder._model
    embedding_params = sum(p.numel() for p in net.get_input_embeddings().parameters())
    weights = sum(p.numel() for p in net.parameters()) - embedding_params
    config = net.config
    attention = 4 * config.num_hidden_layers * width * config.hidden_size
    return 2 * weights + attention


def throughput(embedder: Embedder, texts: list[str], batch_size: int, device: str) -> dict:
    import torch

    batches = [texts[i : i + batch_size] for i in range(0, len(texts), batch_size)]
    embedder.embed(batches[0])  # warm-up: kernels chosen, memory pools filled
    if device == "cuda":
        torch.cuda.synchronize()
    real = computed = passes = 0
    lengths = []
    started = time.perf_counter()
    for batch in batches:
        tokens = embedder.tokenize(batch)
        _, stats = embedder.embed_tokens(tokens)
        real += stats.real_tokens
        computed += stats.computed_tokens
        passes += stats.forward_passes
        lengths.append(tokens.lengths)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    # The passes' widths, for attention's FLOPs: planned again after the clock stops.
    width_tokens = sum(
        p.computed_tokens * p.width
        for batch_lengths in lengths
        for p in embedder.shape_plan.plan(np.sort(batch_lengths))
    )
    mean_width = width_tokens / computed if computed else 0.0
    return {
        "texts_per_s": len(texts) / seconds,
        "real_tokens_per_s": real / seconds,
        "computed_tokens_per_s": computed / seconds,
        "padding_efficiency": real / computed if computed else 1.0,
        "passes": passes,
        "seconds": seconds,
        "tflops": computed * flops_per_token(embedder, mean_width) / seconds / 1e12,
    }


def faiss_check(vectors: np.ndarray) -> dict[str, Any]:
    try:
        import faiss
    except ImportError:
        return {"faiss": "not installed"}
    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
        return {"faiss": "CPU build only (install the gpu extra for faiss-gpu)"}
    queries = vectors[:1000]
    cpu = faiss.IndexFlatIP(vectors.shape[1])
    cpu.add(vectors)
    started = time.perf_counter()
    _, expected = cpu.search(queries, 10)
    cpu_s = time.perf_counter() - started
    resources = faiss.StandardGpuResources()
    gpu = faiss.index_cpu_to_gpu(resources, 0, cpu)
    gpu.search(queries[:10], 10)
    started = time.perf_counter()
    _, found = gpu.search(queries, 10)
    gpu_s = time.perf_counter() - started
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(expected, found, strict=True)])
    return {
        "faiss": faiss.__version__,
        "vectors": len(vectors),
        "queries_per_s_cpu": len(queries) / cpu_s,
        "queries_per_s_gpu": len(queries) / gpu_s,
        "recall_at_10_gpu_vs_cpu": float(recall),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="'default' or a local HF directory")
    parser.add_argument("--texts", type=int, default=20_000)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--precisions", default="bf16,fp16")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: torch sees no CUDA GPU (use --device cpu to check the script)")
        return 2
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else cpu_model()
    precisions = args.precisions.split(",") if args.device == "cuda" else ["fp32"]
    peak = args.peak_tflops or (peak_tflops(name) if args.device == "cuda" else None)
    texts = (sample_texts(args.texts) * (args.texts // len(sample_texts(args.texts)) + 1))[
        : args.texts
    ]
    report: dict[str, Any] = {
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "texts": len(texts),
        "batch_size": args.batch_size,
        "peak_tflops": peak,
        "runs": [],
    }
    print(f"gpu-check: {name}, torch {torch.__version__}, {len(texts)} texts")
    vectors = None
    for precision in precisions:
        embedder = Embedder.load(args.model, precision, args.device)
        for exact in (True, False):
            embedder.exact_shapes = exact
            run = throughput(embedder, texts, args.batch_size, args.device)
            run.update(precision=precision, shapes="exact" if exact else "bucketed")
            run["mfu"] = run["tflops"] / peak if peak else None
            report["runs"].append(run)
            mfu = f", MFU {run['mfu']:.1%}" if run["mfu"] is not None else ""
            print(
                f"  {precision} {run['shapes']:<8} {run['texts_per_s']:9.0f} texts/s "
                f"{run['real_tokens_per_s']:11.0f} tokens/s, padding "
                f"{run['padding_efficiency']:.3f}, {run['tflops']:.1f} TFLOP/s{mfu}"
            )
        if vectors is None:
            vectors = embedder.embed(texts[:20_000])
        embedder.close()
        del embedder
    gate = check_precisions(args.model, args.device, sample_texts(512), precisions, Gate())
    report["quality"] = [r.__dict__ for r in gate]
    for r in gate:
        print(
            f"  gate {r.precision}: cosine mean {r.cosine_mean:.4f} min {r.cosine_min:.4f}, "
            f"recall@10 {r.recall_at_10:.3f}: {'PASS' if r.passed else 'FAIL'}"
        )
    assert vectors is not None
    report["faiss"] = faiss_check(vectors.astype(np.float32))
    print(f"  faiss: {report['faiss']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all(r.passed for r in gate) else 1


if __name__ == "__main__":
    sys.exit(main())
