#!/usr/bin/env python3
"""Nearline latency: produce-to-visible at a steady rate, quiet and with busy cores.

For each worker layout (`--variants`) and each load (quiet, then `--busy N`
processes each keeping one core busy), one run against the real broker: a fresh
topic, a `pipeline run` worker on a fresh group and output, records produced at
`--rate` records/s for `--seconds`, each stamped when sent. A record is visible
when a published Parquet segment holding it appears in the output (listed every
50 ms). The report gives p50, p99 and max produce-to-visible per run, side by
side, and how many records were still not visible at the end (the lag left).

    .venv/bin/python scripts/nearline.py [--rate 20] [--seconds 60] [--busy 1]
        [--variants "default=;before=--replicas 1 --torch-threads 2 --shapes exact"]
        [--model default] [--precision fp32] [--json FILE]

Each run also samples the worker's RSS once a second over the timed part: its
first and last sample, its highest, and the medians of its first and last minute,
for memory over a long nearline run (e.g. `--seconds 3600 --busy 0 --variants
default=`), and its anonymous part; with `--smaps-dir DIR`, copies of its
/proc/PID/smaps at `--smaps-minutes`.

A variant is NAME=[ENV=VALUE ...] EXTRA WORKER FLAGS; `before` is the layout workers had before
replicas and bucketed shapes (one replica with a team of two threads).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import broker  # noqa: E402
from harness.numbers import median, pct  # noqa: E402
from harness.watchers import RssSampler, Visibility  # noqa: E402
from harness.worker import Busy, start  # noqa: E402

from pipeline.core.config import DEFAULT_BOOTSTRAP, KafkaSettings  # noqa: E402
from pipeline.core.corpus import sample_texts  # noqa: E402

READY_TIMEOUT_S = 180


def one_run(kafka: KafkaSettings, args: Any, name: str, extra: str, busy: int, work: Path) -> dict:
    topic = broker.new_topic(kafka, 2, prefix="nearline")
    output = work / f"{name}-busy{busy}"
    # The sample is cycled on long runs: the embedding cache would serve the repeats.
    flags = ["--model", args.model, "--precision", args.precision, "--device", "cpu"]
    worker = start(kafka, topic, output, extra, *flags, "--cache", "off")
    try:
        texts = sample_texts(int(args.rate * args.seconds) + 20)
        with Visibility(output) as visible:
            # Warm-up: the worker has joined and embedded once before timing starts.
            warm = [(f"warm-{n}", texts[n]) for n in range(10)]
            produce(kafka, topic, warm, 100)
            deadline = time.monotonic() + READY_TIMEOUT_S
            while len(visible.seen_at) < len(warm):
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"nearline: worker {name} did not start; see {output}.log")
                time.sleep(0.2)
            smaps_dir = None
            if args.smaps_dir is not None:
                smaps_dir = args.smaps_dir / f"{name}-busy{busy}"
                smaps_dir.mkdir(parents=True, exist_ok=True)
            smaps_at = tuple(int(m * 60) for m in args.smaps_minutes)
            with Busy(busy), RssSampler(worker.pid, smaps_dir, smaps_at) as rss:
                count = int(args.rate * args.seconds)
                pool = texts[10:] or texts
                timed = [(f"r{n}", pool[n % len(pool)]) for n in range(count)]
                sent = produce(kafka, topic, timed, args.rate)
                settle = time.monotonic() + args.settle
                while time.monotonic() < settle and not set(sent) <= set(visible.seen_at):
                    time.sleep(0.1)
            seen = dict(visible.seen_at)
    finally:
        worker.terminate()
        worker.wait(timeout=90)
    latencies = sorted(seen[i] - t for i, t in sent.items() if i in seen)
    missing = len(sent) - len(latencies)
    result = {
        "variant": name,
        "busy": busy,
        "records": len(sent),
        "not_visible": missing,
        "p50_s": pct(latencies, 50),
        "p99_s": pct(latencies, 99),
        "max_s": latencies[-1] if latencies else None,
        # Resident memory over the timed part: first sample, last, highest.
        "rss_first_mb": rss.samples[0] if rss.samples else None,
        "rss_last_mb": rss.samples[-1] if rss.samples else None,
        "rss_max_mb": max(rss.samples) if rss.samples else None,
        "anon_first_mb": rss.anon[0] if rss.anon else None,
        "anon_last_mb": rss.anon[-1] if rss.anon else None,
        # Medians of the first and the last minute: the heap's saw-tooth (tens of MB
        # as batches come and go) makes any one sample a poor end point.
        "rss_first_minute_mb": median(rss.samples[:60]),
        "rss_last_minute_mb": median(rss.samples[-60:]),
        # One sample a minute, to tell steady growth from a saw-tooth (JSON only).
        "rss_per_minute_mb": rss.samples[::60],
        "anon_per_minute_mb": rss.anon[::60],
    }
    broker.delete(kafka, [topic, f"{topic}.dlq"], [])
    return result


def produce(kafka: KafkaSettings, topic: str, records: list[tuple[str, str]], rate: float) -> dict:
    """Publishes (id, text) records at `rate` a second; returns when each was sent."""
    values = [{"id": record_id, "text": text} for record_id, text in records]
    sent_at = broker.publish(kafka, topic, values, 2, rate=rate, check=False, acks=1)
    return {record_id: at for (record_id, _), at in zip(records, sent_at, strict=True)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--busy", type=int, default=1)
    parser.add_argument("--settle", type=float, default=30.0, help="wait after the last send")
    parser.add_argument(
        "--variants", default="default=;before=--replicas 1 --torch-threads 2 --shapes exact"
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--bootstrap-servers", default=DEFAULT_BOOTSTRAP)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--smaps-dir", type=Path, default=None,
        help="copy the worker's /proc/PID/smaps here at --smaps-minutes",
    )  # fmt: skip
    parser.add_argument(
        "--smaps-minutes", type=lambda v: [float(m) for m in v.split(",")],
        default=[0, 1, 5, 10, 20, 30, 45, 59], help="comma-separated minutes into the timed part",
    )  # fmt: skip
    args = parser.parse_args()
    kafka = KafkaSettings(bootstrap_servers=args.bootstrap_servers)
    variants = [v.split("=", 1) for v in args.variants.split(";") if v]
    results = []
    with tempfile.TemporaryDirectory(prefix="nearline-") as work:
        for busy in sorted({0, args.busy}):
            for name, extra in variants:
                result = one_run(kafka, args, name, extra, busy, Path(work))
                results.append(result)
                print(_line(result), flush=True)
    print(f"nearline: {args.rate:g} records/s for {args.seconds:g}s, {args.precision}")
    for result in results:
        print(_line(result))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _line(r: dict) -> str:
    def fmt(v: float | None) -> str:
        return "   -  " if v is None else f"{v:6.2f}"

    return (
        f"  {r['variant']:<8} busy cores {r['busy']}: p50 {fmt(r['p50_s'])}s "
        f"p99 {fmt(r['p99_s'])}s max {fmt(r['max_s'])}s, "
        f"{r['not_visible']} of {r['records']} not visible at the end; RSS "
        f"{r['rss_first_mb']} -> {r['rss_last_mb']} MB (max {r['rss_max_mb']}; medians of the "
        f"first and last minute {r['rss_first_minute_mb']} -> {r['rss_last_minute_mb']}), "
        f"anonymous {r['anon_first_mb']} -> {r['anon_last_mb']} MB"
    )


if __name__ == "__main__":
    sys.exit(main())
