#!/usr/bin/env python3
"""Models side by side: texts/s of each on the same texts, in one run.

Each model embeds the same records of real text (standard-library docstring
paragraphs, `pipeline.core.corpus.sample_texts`, as scripts/bench.py's) the way the
worker's embed stage does: `Embedder.tokenize` (with the model's document prompt)
then `embed_tokens`, length-sorted passes at the worker's layout of replicas x
threads, after a warm-up on a few texts. Every measurement runs in a fresh
process (no heap or caches inherited from the other model), and with --repeat N
the models alternate N rounds; the ratios divide medians, since rates drift on a
shared machine.

    .venv/bin/python scripts/bench_models.py [--models default,multilingual-e5-small]
        [--records 2000] [--precision fp32] [--device cpu] [--repeat 3] [--json FILE]

Prints, per model: texts/s, tokens/s (real tokens, the prompt's included), tokens per
text, then each model's texts/s against the first one's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WARMUP_TEXTS = 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        default="default,multilingual-e5-small",
        help="comma-separated, as `pipeline run --model`; the first is the reference",
    )
    parser.add_argument("--records", type=int, default=2000, help="texts to embed")
    parser.add_argument("--precision", default="fp32", help="as `pipeline run --precision`")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    parser.add_argument("--repeat", type=int, default=3, help="rounds, models alternating")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per measurement, seconds")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.records <= 0 or args.repeat <= 0:
        parser.error("--records and --repeat must be positive")
    return args


def make_texts(n: int) -> list[str]:
    """n real paragraphs; past what the corpus holds, repeated with a suffix."""
    from pipeline.core.corpus import sample_texts

    base = sample_texts(n)
    texts, rounds = list(base[:n]), 1
    while len(texts) < n:
        texts += [f"{t} ({rounds})" for t in base[: n - len(texts)]]
        rounds += 1
    return texts


def child(args: argparse.Namespace) -> int:
    """One model, one measurement: prints {"seconds", "tokens", ...} as JSON."""
    import torch

    from pipeline.core.host import call_on_fresh_thread, plan_cpu, usable_cpus
    from pipeline.model.embedder import Embedder, pick_device

    plan = plan_cpu(pick_device(args.device), usable_cpus())
    torch.set_num_threads(plan.threads_per_replica)
    texts = make_texts(args.records)

    def measure() -> dict[str, object]:
        embedder = Embedder.load_planned(args.child, args.precision, plan)
        embedder.embed_tokens(embedder.tokenize(texts[:WARMUP_TEXTS]))
        started = time.perf_counter()
        tokens = embedder.tokenize(texts)
        embedder.embed_tokens(tokens)
        seconds = time.perf_counter() - started
        info = embedder.info
        embedder.close()
        return {
            "seconds": seconds,
            "tokens": tokens.total_tokens,
            "truncated": tokens.truncated,
            "name": info.name,
            "dim": info.dim,
            "document_prompt": info.document_prompt,
            "plan": str(plan),
        }

    print(json.dumps(call_on_fresh_thread(measure)), flush=True)
    return 0


def run_child(args: argparse.Namespace, model: str) -> dict[str, object]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", model]
    command += ["--records", str(args.records), "--precision", args.precision]
    command += ["--device", args.device]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")  # as `pipeline run` sets it
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
    if proc.returncode != 0:
        sys.exit(f"{model}: exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child(args)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    runs: dict[str, list[dict[str, object]]] = {m: [] for m in models}
    for round_no in range(1, args.repeat + 1):
        for model in models:
            result = run_child(args, model)
            runs[model].append(result)
            rate = args.records / float(result["seconds"])
            print(f"  round {round_no}: {model:<28} {rate:9.1f} texts/s", flush=True)
    rows = []
    for model in models:
        rates = [args.records / float(r["seconds"]) for r in runs[model]]
        first = runs[model][0]
        median = statistics.median(rates)
        rows.append(
            {
                "model": model,
                "texts_per_s": median,
                "tokens_per_s": median * int(first["tokens"]) / args.records,
                "tokens_per_text": int(first["tokens"]) / args.records,
                "truncated": first["truncated"],
                "dim": first["dim"],
                "document_prompt": first["document_prompt"],
                "rounds": rates,
            }
        )
    print(
        f"\n{args.records} texts (stdlib paragraphs), {args.precision} on {args.device}, "
        f"{runs[models[0]][0]['plan']}, medians of {args.repeat} round(s)"
    )
    print(f"{'model':<28}{'texts/s':>10}{'tokens/s':>11}{'tok/text':>10}  prompt   vs first")
    for row in rows:
        ratio = row["texts_per_s"] / rows[0]["texts_per_s"]
        print(
            f"{row['model']:<28}{row['texts_per_s']:>10.1f}{row['tokens_per_s']:>11.0f}"
            f"{row['tokens_per_text']:>10.1f}  {row['document_prompt']!r:<8} {ratio:8.2f}"
        )
    for row in rows[1:]:
        # Each round's pair ran a minute apart at most: steadier on a drifting machine.
        paired = [b / a for a, b in zip(rows[0]["rounds"], row["rounds"], strict=True)]
        row["paired_ratios"] = paired
        print(
            f"{row['model']} / {rows[0]['model']} per round: "
            + ", ".join(f"{r:.2f}" for r in paired)
            + f" (median {statistics.median(paired):.2f})"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"records": args.records, "models": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
