#!/usr/bin/env python3
"""The embedding hot path without Kafka: shapes, threads and memory, side by side.

Each variant runs in a fresh process of its own (a process's heap and oneDNN's
caches remember what ran before), on the same texts, and the ratios compare
variants measured in the same run on the same machine.

  shapes   exact pass shapes against bucketed ones (pipeline.model.shapes) over a
           stream of micro-batches in arrival order: texts/s over the first and
           the second half of the stream, padding efficiency, distinct shapes met,
           and RSS after the first batch, at the end and at its peak.
  threads  model layouts (replicas x threads per replica) on a quiet machine
           and with `--busy N` processes each keeping one core busy: texts/s.

    .venv/bin/python scripts/hotpath.py shapes [--texts 30000] [--batch-size 512]
    .venv/bin/python scripts/hotpath.py threads [--texts 1500] [--busy 1]
        [--layouts 1x2,2x1,1x1]

Options common to both: --precision (fp32), --model (default), --json FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.worker import Busy, own_peak_rss_mb  # noqa: E402


def stream_texts(count: int) -> list[str]:
    """`count` texts of real prose: the stdlib sample, then joined pairs of it, so
    that a long stream keeps meeting new lengths, as a real one does."""
    from pipeline.core.corpus import sample_texts

    base = sample_texts(count)
    texts = list(base)
    rounds = 1
    while len(texts) < count:
        for i, text in enumerate(base):
            partner = base[(i * 31 + rounds * 7) % len(base)]
            texts.append(f"{text} {partner[: 40 * rounds]}")
            if len(texts) == count:
                break
        rounds += 1
    return texts


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


# -- children: one variant each, in a fresh process --------------------------------


def child_shapes(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    from pipeline.core.host import release_free_memory

    embedder = _load(spec, replicas=spec["replicas"], threads=spec["threads"])
    embedder.exact_shapes = spec["exact"]
    texts = stream_texts(spec["texts"])
    size = spec["batch_size"]
    shapes: set[tuple[int, int]] = set()
    real = computed = 0
    halves = [0.0, 0.0]
    after_first = None
    for start in range(0, len(texts), size):
        tokens = embedder.tokenize(texts[start : start + size])
        order = np.sort(tokens.lengths, kind="stable")
        shapes |= {(p.count, p.width) for p in embedder.shape_plan.plan(order)}
        began = time.perf_counter()
        _, stats = embedder.embed_tokens(tokens)
        if spec["trim"]:
            release_free_memory()  # as the worker's embed stage does after each batch
        halves[start >= len(texts) // 2] += time.perf_counter() - began
        real, computed = real + stats.real_tokens, computed + stats.computed_tokens
        if after_first is None:
            after_first = rss_mb()
    half = len(texts) / 2
    return {
        "variant": ("exact" if spec["exact"] else "bucketed") + ("+trim" if spec["trim"] else ""),
        "texts_per_s_first_half": half / halves[0],
        "texts_per_s_second_half": half / halves[1],
        "texts_per_s": len(texts) / sum(halves),
        "padding_efficiency": real / computed,
        "distinct_shapes": len(shapes),
        "rss_after_first_batch_mb": after_first,
        "rss_end_mb": rss_mb(),
        "rss_peak_mb": own_peak_rss_mb(),
    }


def child_threads(spec: dict[str, Any]) -> dict[str, Any]:
    embedder = _load(spec, replicas=spec["replicas"], threads=spec["threads"])
    texts = stream_texts(spec["texts"])
    size = spec["batch_size"]
    began = time.perf_counter()
    for start in range(0, len(texts), size):
        embedder.embed_tokens(embedder.tokenize(texts[start : start + size]))
    seconds = time.perf_counter() - began
    return {
        "variant": f"{spec['replicas']}x{spec['threads']}",
        "busy": spec["busy"],
        "texts_per_s": len(texts) / seconds,
    }


def _load(spec: dict[str, Any], replicas: int, threads: int) -> Any:
    import torch

    from pipeline.core.host import call_on_fresh_thread
    from pipeline.model.embedder import Embedder

    torch.set_num_threads(threads)
    return call_on_fresh_thread(
        lambda: Embedder.load(
            spec["model"], spec["precision"], "cpu", replicas=replicas, threads_per_replica=threads
        )
    )


CHILDREN = {"shapes": child_shapes, "threads": child_threads}


def run_child(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", kind, json.dumps(spec)],
        capture_output=True,
        text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    if done.returncode != 0:
        raise SystemExit(f"hotpath: {kind} {spec} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the parent: variants side by side -----------------------------------------------


def measure_shapes(args: argparse.Namespace, base: dict[str, Any]) -> dict[str, Any]:
    spec = {**base, "texts": args.texts, "batch_size": args.batch_size}
    spec.update(replicas=1, threads=1)
    variants = [(True, False), (False, False), (False, True)]  # (exact, trim)
    results = [run_child("shapes", {**spec, "exact": e, "trim": t}) for e, t in variants]
    exact, bucketed, _ = results
    print(f"shapes: {args.texts} texts in micro-batches of {args.batch_size}, {args.precision}")
    header = "variant         texts/s  1st half  2nd half  padding  shapes  RSS first  end   peak"
    print(header)
    for r in results:
        print(
            f"{r['variant']:<14} {r['texts_per_s']:8.1f} {r['texts_per_s_first_half']:9.1f} "
            f"{r['texts_per_s_second_half']:9.1f} {r['padding_efficiency']:8.3f} "
            f"{r['distinct_shapes']:7d} {r['rss_after_first_batch_mb']:9.0f} "
            f"{r['rss_end_mb']:6.0f} {r['rss_peak_mb']:6.0f}"
        )
    ratios = {
        "texts_per_s": bucketed["texts_per_s"] / exact["texts_per_s"],
        "growth_mb_exact": exact["rss_peak_mb"] - exact["rss_after_first_batch_mb"],
        "growth_mb_bucketed": bucketed["rss_peak_mb"] - bucketed["rss_after_first_batch_mb"],
    }
    print(
        f"bucketed/exact texts/s {ratios['texts_per_s']:.2f}; RSS growth after the first batch: "
        f"exact {ratios['growth_mb_exact']:.0f} MB, bucketed {ratios['growth_mb_bucketed']:.0f} MB"
    )
    return {"results": results, "ratios": ratios}


def measure_threads(args: argparse.Namespace, base: dict[str, Any]) -> dict[str, Any]:
    spec = {**base, "texts": args.texts, "batch_size": args.batch_size}
    layouts = [tuple(int(n) for n in layout.split("x")) for layout in args.layouts.split(",")]
    results = []
    for busy in sorted({0, args.busy}):
        with Busy(busy):
            for replicas, threads in layouts:
                layout = {"replicas": replicas, "threads": threads, "busy": busy}
                results.append(run_child("threads", {**spec, **layout}))
    print(f"threads: {args.texts} texts in micro-batches of {args.batch_size}, {args.precision}")
    for r in results:
        print(f"  {r['variant']:<5} busy cores {r['busy']}: {r['texts_per_s']:7.1f} texts/s")
    first = results[0]["texts_per_s"]
    for r in results[1:]:
        print(
            f"  {r['variant']} busy {r['busy']} / {results[0]['variant']} busy 0: "
            f"{r['texts_per_s'] / first:.2f}"
        )
    return {"results": results}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=sorted(CHILDREN))
    parser.add_argument("--texts", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--busy", type=int, default=1, help="busy cores in the loaded runs")
    parser.add_argument("--layouts", default="1x2,2x1,1x1", help="REPLICASxTHREADS,...")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "int8"))
    parser.add_argument("--model", default="default")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    defaults = {"shapes": (30_000, 512), "threads": (1_500, 64)}[args.what]
    args.texts = args.texts or defaults[0]
    args.batch_size = args.batch_size or defaults[1]
    base = {"model": args.model, "precision": args.precision}
    measure = measure_shapes if args.what == "shapes" else measure_threads
    report = measure(args, base)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
