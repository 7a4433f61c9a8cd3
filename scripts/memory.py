#!/usr/bin/env python3
"""Peak memory of `pipeline run --until-end` against the size of the backlog.

For each backlog (`--backlogs`, records of short real text published to a fresh
topic before the worker starts; the stdlib sample cycled, so every backlog has
the same mix of lengths) and each variant (`--variants`, extra worker
flags), one worker runs the backlog to the end with default settings; its peak
RSS is that of the worker and its child processes (tokenizer, OpenVINO replicas)
together, sampled every 0.1 s, with the kernel's ru_maxrss of the worker alone
beside it. The report puts the peaks side by
side and gives each variant's growth from the smallest backlog to the largest:
a worker's memory must be bounded by its batches in flight, not by what waits
in Kafka.

    .venv/bin/python scripts/memory.py [--backlogs 500,30000,100000]
        [--variants "default=;before=--replicas 1 --torch-threads 2 --shapes exact"]
        [--model default] [--precision fp32] [--repeat 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import broker, worker  # noqa: E402
from harness.worker import own_peak_rss_mb  # noqa: E402

from pipeline.core.config import DEFAULT_BOOTSTRAP, KafkaSettings  # noqa: E402
from pipeline.core.corpus import sample_texts  # noqa: E402


def publish(kafka: KafkaSettings, count: int) -> str:
    topic = broker.new_topic(kafka, 3, prefix="memory")
    # The same texts, in the same proportions, at every backlog: only its size differs.
    base = sample_texts(count)
    values = ({"id": f"r{n}", "text": base[n % len(base)]} for n in range(count))
    broker.publish(kafka, topic, values, 3, linger_ms=50, batch_size=512 * 1024)
    return topic


def peak_rss_mb(kafka: KafkaSettings, topic: str, extra: str, args: argparse.Namespace) -> dict:
    # The sample is cycled: the embedding cache would serve every repeat.
    flags = ["--model", args.model, "--precision", args.precision, "--device", "cpu"]
    run = worker.run_until_end(
        kafka, topic, Path(args.work), extra, *flags, "--cache", "off", timeout_s=7200
    )
    return {
        "peak_rss_mb": run.peak_rss_mb,
        "peak_tree_rss_mb": run.peak_tree_rss_mb,
        "seconds": run.seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backlogs", default="500,30000,100000")
    parser.add_argument(
        "--variants", default="default=;before=--replicas 1 --torch-threads 2 --shapes exact"
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--work", default=f"/tmp/memory-{os.getpid()}")
    parser.add_argument("--bootstrap-servers", default=DEFAULT_BOOTSTRAP)
    parser.add_argument(
        "--repeat", type=int, default=1,
        help="runs per backlog and variant; peaks are compared by their medians (the "
        "peak of a small backlog moved by up to ~80 MB between runs)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    kafka = KafkaSettings(bootstrap_servers=args.bootstrap_servers)
    backlogs = [int(b) for b in args.backlogs.split(",")]
    variants = [v.split("=", 1) for v in args.variants.split(";") if v]
    results: list[dict] = []
    for backlog in backlogs:
        topic = publish(kafka, backlog)
        for _ in range(args.repeat):
            for name, extra in variants:
                run = peak_rss_mb(kafka, topic, extra, args)
                results.append({"variant": name, "backlog": backlog, **run})
                print(
                    f"  {name:<8} backlog {backlog:>7}: peak RSS {run['peak_tree_rss_mb']:7.0f} MB "
                    f"(the worker alone {run['peak_rss_mb']:.0f} MB; {run['seconds']:.0f}s)",
                    flush=True,
                )
        broker.delete(kafka, [topic], [])
    print(
        f"memory: peak RSS (the worker and its processes) by backlog, {args.precision}, "
        f"own RSS {own_peak_rss_mb():.0f} MB"
    )
    for name, _ in variants:
        peaks = {
            b: [
                r["peak_tree_rss_mb"] for r in results if r["variant"] == name and r["backlog"] == b
            ]
            for b in backlogs
        }
        row = "  ".join(f"{b}: {_spread(peaks[b])}" for b in backlogs)
        growth = statistics.median(peaks[backlogs[-1]]) - statistics.median(peaks[backlogs[0]])
        print(f"  {name:<8} {row}  growth {growth:+.0f} MB")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _spread(peaks: list[float]) -> str:
    """The median peak, with the range where the backlog ran more than once."""
    median = f"{statistics.median(peaks):.0f} MB"
    return median if len(peaks) == 1 else f"{median} ({min(peaks):.0f}-{max(peaks):.0f})"


if __name__ == "__main__":
    sys.exit(main())
