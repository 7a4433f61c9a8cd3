#!/usr/bin/env python3
"""Peak memory of `pipeline run --until-end` against the size of the backlog.

For each backlog (`--backlogs`, records of short real text published to a fresh
topic before the worker starts; the stdlib sample cycled, so every backlog has
the same mix of lengths) and each variant (`--variants`, extra worker
flags), one worker runs the backlog to the end with default settings; its peak
RSS is the kernel's ru_maxrss of the child. The report puts the peaks side by
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
import resource
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from hotpath import split_variant  # noqa: E402

from pipeline.core.config import DEFAULT_BOOTSTRAP, KafkaSettings  # noqa: E402
from pipeline.core.corpus import sample_texts  # noqa: E402
from pipeline.kafka import cluster  # noqa: E402

# Runs the worker and prints its exit code and peak RSS (kB): a process of its
# own, so that ru_maxrss of its children is this worker's alone.
_WRAPPER = (
    "import json, resource, subprocess, sys\n"
    "rc = subprocess.run(json.loads(sys.argv[1]), stdout=subprocess.DEVNULL,"
    " stderr=open(sys.argv[2], 'w')).returncode\n"
    "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)


def publish(kafka: KafkaSettings, count: int) -> str:
    from kafka import KafkaProducer

    topic = f"memory-{uuid.uuid4().hex[:10]}"
    with cluster.admin_client(kafka) as admin:
        cluster.create_topic(admin, kafka, topic, 3)
    producer = KafkaProducer(linger_ms=50, batch_size=512 * 1024, **kafka.client_kwargs())
    # The same texts, in the same proportions, at every backlog: only its size differs.
    base = sample_texts(count)
    for n in range(count):
        text = base[n % len(base)]
        producer.send(topic, json.dumps({"id": f"r{n}", "text": text}).encode(), partition=n % 3)
    producer.flush(timeout=600)
    producer.close(timeout=30)
    return topic


def peak_rss_mb(kafka: KafkaSettings, topic: str, extra: str, args: argparse.Namespace) -> dict:
    group = f"memory-{uuid.uuid4().hex[:8]}"
    variant_env, flags = split_variant(extra)
    output = Path(args.work) / group
    command = [
        sys.executable, "-m", "pipeline.cli", "--bootstrap-servers", kafka.bootstrap_servers,
        "run", "--topic", topic, "--group", group, "--output", str(output), "--until-end",
        "--model", args.model, "--precision", args.precision, "--device", "cpu",
        # The sample is cycled: the embedding cache would serve every repeat.
        "--no-progress", "--cache", "off", *flags,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **variant_env}
    log = Path(args.work) / f"{group}.log"
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _WRAPPER, json.dumps(command), str(log)],
        capture_output=True,
        text=True,
        env=env,
        timeout=7200,
    )
    rc, kb = done.stdout.split()
    if rc != "0":
        raise SystemExit(f"memory: worker failed (exit {rc}); see {log}")
    return {"peak_rss_mb": int(kb) / 1024, "seconds": time.monotonic() - began}


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
                    f"  {name:<8} backlog {backlog:>7}: peak RSS {run['peak_rss_mb']:7.0f} MB "
                    f"({run['seconds']:.0f}s)",
                    flush=True,
                )
        with cluster.admin_client(kafka) as admin:
            admin.delete_topics([topic])
    print(f"memory: peak RSS by backlog, {args.precision}, own RSS {_own_mb():.0f} MB")
    for name, _ in variants:
        peaks = {
            b: [r["peak_rss_mb"] for r in results if r["variant"] == name and r["backlog"] == b]
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


def _own_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    sys.exit(main())
