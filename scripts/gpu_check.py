#!/usr/bin/env python3
"""The embedding path alone on a CUDA GPU: speed, utilisation and quality, in minutes.

Needs torch, transformers and numpy (faiss optional); no Kafka, no Java, no network.
Over a stream of micro-batches of real prose, each figure the median of --repeats:

- tokenizing alone by tokenizer threads: the CPU side's ceiling for a GPU;
- the forward passes alone (batches tokenized beforehand) for each precision (bf16,
  fp16), exact pass shapes against bucketed ones (pipeline.model.shapes), and for the first
  precision each sub-batch token budget: texts/s, tokens/s and model FLOP utilisation
  (FLOPs per computed token, 2 x the non-embedding weights plus attention's
  4 x width x hidden per layer, times computed tokens/s, over the GPU's dense peak);
- end to end as the worker runs it (the next batch tokenized while the model runs
  this one) at the best precision and budget, by model replicas and tokenizer threads;
- the quality gate against fp32 on the same GPU (pipeline.model.precision);
- FAISS on the GPU against the CPU when faiss-gpu is installed.

    scripts/gpu-check.sh [--model DIR] [--texts 40000] [--batch-size 4096]
        [--precisions bf16,fp16] [--budgets 8192,32768,131072]
        [--tokenizer-threads 1,2,4,8,15] [--repeats 3] [--peak-tflops N]
        [--json FILE] [--device cuda]

`--device cpu` runs the same steps on the CPU (fp32 only; MFU left out): a check
of the script itself where no GPU is at hand.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from pipeline.core.corpus import sample_texts  # noqa: E402
from pipeline.core.host import usable_cpus  # noqa: E402
from pipeline.model.embedder import Embedder, Tokenized  # noqa: E402
from pipeline.model.precision import Gate, check_precisions, cpu_model  # noqa: E402

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


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _median_seconds(fn: Any, device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def tokenizer_scaling(
    embedder: Embedder, batches: list[list[str]], counts: list[int], repeats: int
) -> list[dict[str, Any]]:
    """Texts/s of tokenizing alone, by tokenizer threads: the CPU side's ceiling."""
    texts = sum(len(b) for b in batches)
    rows = []
    for count in counts:
        embedder.tokenizer_threads = count
        embedder._tokenizers = None  # a pool of the new size on first use
        seconds = _median_seconds(lambda: [embedder.tokenize(b) for b in batches], "cpu", repeats)
        rows.append({"threads": count, "texts_per_s": texts / seconds})
    return rows


def model_only(
    embedder: Embedder, tokenized: list[Tokenized], device: str, repeats: int
) -> dict[str, Any]:
    """The forward passes alone (batches tokenized beforehand), with FLOPs and MFU inputs."""
    # Warm-up over every batch: each new pass shape chooses its kernels once; the
    # counts for tokens/s and FLOPs come from it.
    stats = [embedder.embed_tokens(t)[1] for t in tokenized]

    def passes() -> None:
        for t in tokenized:
            embedder.embed_tokens(t)

    seconds = _median_seconds(passes, device, repeats)
    real = sum(s.real_tokens for s in stats)
    computed = sum(s.computed_tokens for s in stats)
    # The passes' widths, for attention's FLOPs: planned again outside the clock.
    width_tokens = sum(
        p.computed_tokens * p.width
        for t in tokenized
        for p in embedder.shape_plan.plan(np.sort(t.lengths))
    )
    mean_width = width_tokens / computed if computed else 0.0
    return {
        "texts_per_s": sum(len(t) for t in tokenized) / seconds,
        "real_tokens_per_s": real / seconds,
        "computed_tokens_per_s": computed / seconds,
        "padding_efficiency": real / computed if computed else 1.0,
        "passes": sum(s.forward_passes for s in stats),
        "seconds": seconds,
        "tflops": computed * flops_per_token(embedder, mean_width) / seconds / 1e12,
    }


def end_to_end(embedder: Embedder, batches: list[list[str]], device: str) -> dict[str, Any]:
    """Tokenize and embed as the worker does: the next batch is tokenized (on the poll
    thread there) while the model runs this one (on the embed stage's thread). Also
    reports each side's busy seconds, to show which one the other slows down."""
    from concurrent.futures import ThreadPoolExecutor

    for batch in batches:  # warm-up: every pass shape met once, as in model_only
        embedder.embed(batch)
    tokenize_s = embed_s = 0.0

    def tokenize(batch: list[str]) -> Tokenized:
        nonlocal tokenize_s
        began = time.perf_counter()
        tokens = embedder.tokenize(batch)
        tokenize_s += time.perf_counter() - began
        return tokens

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="poll") as poll:
        _sync(device)
        started = time.perf_counter()
        upcoming = poll.submit(tokenize, batches[0])
        for i in range(len(batches)):
            tokens = upcoming.result()
            if i + 1 < len(batches):
                upcoming = poll.submit(tokenize, batches[i + 1])
            began = time.perf_counter()
            embedder.embed_tokens(tokens)
            embed_s += time.perf_counter() - began
        _sync(device)
        seconds = time.perf_counter() - started
    return {
        "texts_per_s": sum(len(b) for b in batches) / seconds,
        "seconds": seconds,
        "tokenize_busy_s": tokenize_s,
        "embed_busy_s": embed_s,
    }


def with_replicas(embedder: Embedder, replicas: int, tokenizer_threads: int) -> Embedder:
    """The same loaded weights, driven by `replicas` threads."""
    return embedder.with_replicas(replicas, tokenizer_threads=tokenizer_threads)


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
    parser.add_argument("--texts", type=int, default=40_000)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--precisions", default="bf16,fp16")
    parser.add_argument("--budgets", default="8192,32768,131072", help="sub-batch tokens")
    parser.add_argument("--padding-targets", default="0.92,0.75,0.5")
    parser.add_argument("--tokenizer-threads", default="1,2,4,8,15")
    parser.add_argument(
        "--e2e-threads", default="1,8", help="tokenizer threads end to end (0: the Rust pool)"
    )
    parser.add_argument("--switch-ms", default="5", help="GIL switch intervals, end to end")
    parser.add_argument("--join", type=int, default=1, help="texts joined per record (longer)")
    parser.add_argument("--repeats", type=int, default=3)
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
    budgets = [int(b) for b in args.budgets.split(",")]
    peak = args.peak_tflops or (peak_tflops(name) if args.device == "cuda" else None)
    sample = sample_texts(args.texts)
    texts = (sample * (args.texts * args.join // len(sample) + 1))[: args.texts * args.join]
    texts = [" ".join(texts[i : i + args.join]) for i in range(0, len(texts), args.join)]
    batches = [texts[i : i + args.batch_size] for i in range(0, len(texts), args.batch_size)]
    report: dict[str, Any] = {
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpus": usable_cpus(),
        "texts": len(texts),
        "batch_size": args.batch_size,
        "peak_tflops": peak,
        "runs": [],
    }

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))

    print(f"gpu-check: {name}, torch {torch.__version__}, {usable_cpus()} CPUs, {len(texts)} texts")
    vectors = None
    best: dict[str, Any] | None = None
    for precision in precisions:
        embedder = Embedder.load(args.model, precision, args.device, budgets[0])
        if vectors is None:
            counts = [int(c) for c in args.tokenizer_threads.split(",")]
            report["tokenizer"] = tokenizer_scaling(embedder, batches, counts, args.repeats)
            print(
                "  tokenize only: "
                + ", ".join(
                    f"{r['threads']} thr {r['texts_per_s']:.0f}/s" for r in report["tokenizer"]
                )
            )
            embedder.tokenizer_threads = max(counts)
            embedder._tokenizers = None
            tokenized = [embedder.tokenize(b) for b in batches]
            save()
        targets = [float(t) for t in args.padding_targets.split(",")]
        shapes = [(True, budgets[0], targets[0])]
        shapes += [(False, b, t) for b in budgets for t in targets]
        for exact, budget, target in shapes if precision == precisions[0] else shapes[:2]:
            embedder.exact_shapes = exact
            embedder.sub_batch_tokens = budget
            embedder.padding_target = target
            run = model_only(embedder, tokenized, args.device, args.repeats)
            run.update(
                precision=precision,
                shapes="exact" if exact else "bucketed",
                budget=budget,
                padding_target=target,
            )
            run["mfu"] = run["tflops"] / peak if peak else None
            report["runs"].append(run)
            if not exact and (best is None or run["texts_per_s"] > best["texts_per_s"]):
                best = run
            mfu = f", MFU {run['mfu']:.1%}" if run["mfu"] is not None else ""
            print(
                f"  model only {precision} {run['shapes']:<8} budget {budget:>6} "
                f"target {target:.2f}: "
                f"{run['texts_per_s']:8.0f} texts/s {run['real_tokens_per_s']:10.0f} tokens/s, "
                f"padding {run['padding_efficiency']:.3f}, {run['passes']} passes, "
                f"{run['tflops']:.1f} TFLOP/s{mfu}"
            )
            save()
        if vectors is None:
            vectors = embedder.embed(texts[:20_000])
        embedder.close()
        del embedder
    assert best is not None
    report["best"] = {k: best[k] for k in ("precision", "budget", "padding_target", "texts_per_s")}
    report["end_to_end"] = []
    loaded = Embedder.load(args.model, best["precision"], args.device, best["budget"])
    default_interval = sys.getswitchinterval()
    for replicas in (1, 2):
        for switch_ms in [float(m) for m in args.switch_ms.split(",")]:
            for threads in [int(t) for t in args.e2e_threads.split(",")]:
                sys.setswitchinterval(switch_ms / 1000)
                # 0 tokenizer threads: one call per batch on the Rust tokenizer's own pool.
                os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads == 0 else "false"
                embedder = with_replicas(loaded, replicas, max(1, threads))
                embedder.padding_target = best["padding_target"]
                run = end_to_end(embedder, batches, args.device)
                embedder.close()
                sys.setswitchinterval(default_interval)
                run.update(replicas=replicas, tokenizer_threads=threads, switch_ms=switch_ms)
                report["end_to_end"].append(run)
                print(
                    f"  end to end {best['precision']} budget {best['budget']} target "
                    f"{best['padding_target']}: {replicas} replica(s), {threads} tokenizer "
                    f"thread(s), GIL switch {switch_ms} ms: {run['texts_per_s']:8.0f} texts/s "
                    f"(busy: tokenize {run['tokenize_busy_s']:.2f} s, embed "
                    f"{run['embed_busy_s']:.2f} s of {run['seconds']:.2f} s)"
                )
                save()
    loaded.close()
    del loaded
    gate = check_precisions(args.model, args.device, sample_texts(512), precisions, Gate())
    report["quality"] = [r.__dict__ for r in gate]
    for r in gate:
        print(
            f"  gate {r.precision}: cosine mean {r.cosine_mean:.4f} min {r.cosine_min:.4f}, "
            f"recall@10 {r.recall_at_10:.3f}: {'PASS' if r.passed else 'FAIL'}"
        )
    save()
    assert vectors is not None
    report["faiss"] = faiss_check(vectors.astype(np.float32))
    print(f"  faiss: {report['faiss']}")
    save()
    return 0 if all(r.passed for r in gate) else 1


if __name__ == "__main__":
    sys.exit(main())
