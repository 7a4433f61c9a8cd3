#!/usr/bin/env python3
"""The path around the model: the pipeline with a near-free model against bare Kafka.

One run, one fresh topic of short JSON records, side by side:

  (bare) kafka-python's KafkaConsumer from the beginning, `json.loads` of every value,
         until every record was read: what no pipeline can beat on this host;
  (pipe) `pipeline run --until-end` with a random BERT (scripts/tiny_model.py; `--tiny
         nano` by default: one layer of 8 dimensions, yet 15-20 µs of CPU a text;
         `--tiny zero`, no layer at all, costs least; `--tiny tiny` about as much as the
         tokenizer), a fresh group and output:
         records/s from its `done:` line (first record to last commit), and start-up, from process
         start to the first record polled (its log line).

The ratio pipe/bare is the share of Kafka's own speed the pipeline keeps; the target
is at least 0.5. Both are also given in CPU time per record, which a busy or throttled
host disturbs less than records/s: bare's process time from its first record to its
last, and the worker's from its first record polled to its `done:` line (read from
/proc: the worker process, and with its children, the tokenizer process among them).
`--corpus chinese|mixed` publishes Chinese (or half Chinese) text found on the machine
instead of English (scripts/tokenize_bench.py). Rounds alternate (--repeat N) and the
medians are compared.

--variants runs the pipeline once per variant in every round: NAME=[ENV=VALUE ...]
[WORKER FLAGS], e.g. "fast=;rust=PIPELINE_TOKENIZER=rust" (the WordPiece fast
path against the Rust tokenizer) or "native=;transformers=PIPELINE_ENCODER=transformers".

    .venv/bin/python scripts/overhead.py [--records 50000] [--partitions 3] [--repeat 3]
        [--variants "default="] [--tiny zero|nano|tiny] [--corpus english|chinese|mixed]
        [--bootstrap-servers 127.0.0.1:9092] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import broker, worker  # noqa: E402
from harness.corpora import CORPORA  # noqa: E402

from pipeline.core.config import DEFAULT_BOOTSTRAP, KafkaSettings  # noqa: E402


def publish(kafka: KafkaSettings, records: int, partitions: int, corpus: str = "english") -> str:
    texts = CORPORA[corpus](records) if corpus in CORPORA else None
    if not texts:
        raise SystemExit(
            f"overhead: no {corpus} text on this machine (see scripts/tokenize_bench.py)"
        )
    topic = broker.new_topic(kafka, partitions, prefix="overhead")
    values = ({"id": f"r{n}", "text": texts[n % len(texts)][:300]} for n in range(records))
    broker.publish(kafka, topic, values, partitions, batch_size=256 * 1024)
    return topic


def bare(kafka: KafkaSettings, topic: str, records: int) -> dict[str, float]:
    """records/s of consume + json.loads, first record to last, and CPU µs a record."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(
        topic,
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        max_poll_records=4096,
        **kafka.client_kwargs(),
    )
    seen, first, first_cpu = 0, None, 0.0
    deadline = time.monotonic() + 600
    try:
        while seen < records and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                if first is None:
                    first, first_cpu = time.perf_counter(), time.process_time()
                for record in batch:
                    json.loads(record.value)
                seen += len(batch)
        elapsed, cpu = time.perf_counter() - (first or 0), time.process_time() - first_cpu
    finally:
        consumer.close()
    if seen < records or first is None:
        raise SystemExit(f"overhead: bare consumer read {seen} of {records}")
    return {"rate": seen / elapsed, "cpu_us": cpu / seen * 1e6}


def pipe(
    kafka: KafkaSettings, topic: str, records: int, model: str, work: Path, extra: str
) -> dict:
    # The sample is cycled: the embedding cache would serve every repeat.
    flags = ["--model", model, "--precision", "fp32", "--device", "cpu", "--cache", "off"]
    got = worker.run_until_end(kafka, topic, work, extra, *flags)
    assert got.done is not None and got.startup_s is not None
    if got.done.records != records:
        raise SystemExit(f"overhead: the worker read {got.done.records} of {records} records")
    return {
        "rate": got.done.rate,
        "startup_s": got.startup_s,
        "cpu_us": got.cpu_us_per_record(),
        "worker_cpu_us": (got.worker_cpu_s or 0.0) / records * 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--variants",
        default="default=",
        help="NAME=[ENV=VALUE ...] [WORKER FLAGS];... each run every round",
    )
    parser.add_argument(
        "--tiny", choices=("zero", "nano", "tiny"), default="nano",
        help="the random model (scripts/tiny_model.py): zero costs least, then nano",
    )  # fmt: skip
    parser.add_argument(
        "--corpus", choices=("english", "chinese", "mixed"), default="english",
        help="the texts published (scripts/tokenize_bench.py; chinese needs CJK text here)",
    )  # fmt: skip
    parser.add_argument("--bootstrap-servers", default=DEFAULT_BOOTSTRAP)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    variants = dict(v.split("=", 1) for v in args.variants.split(";") if v.strip())
    kafka = KafkaSettings(bootstrap_servers=args.bootstrap_servers)
    model = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "tiny_model.py"), f"--{args.tiny}"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    topic = publish(kafka, args.records, args.partitions, args.corpus)
    bares: list[dict[str, float]] = []
    pipes: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="overhead-") as work:
        for n in range(args.repeat):
            bares.append(bare(kafka, topic, args.records))
            line = (
                f"round {n + 1}: bare {bares[-1]['rate']:,.0f} records/s "
                f"({bares[-1]['cpu_us']:.1f} µs CPU a record)"
            )
            for name, extra in variants.items():
                got = pipe(kafka, topic, args.records, model, Path(work), extra)
                pipes[name].append(got)
                line += (
                    f", pipeline ({name}) {got['rate']:,.0f} records/s "
                    f"({got['cpu_us']:.1f} µs, worker process {got['worker_cpu_us']:.1f}), "
                    f"start-up {got['startup_s']:.1f}s"
                )
            print(line, flush=True)
    bare_rate = statistics.median(b["rate"] for b in bares)
    bare_cpu = statistics.median(b["cpu_us"] for b in bares)
    # The first variant's figures are also at the top level.
    report: dict[str, Any] = {"bare": bares, "variants": {}}
    for name, runs in pipes.items():
        pipe_rate = statistics.median(p["rate"] for p in runs)
        startup = statistics.median(p["startup_s"] for p in runs)
        cpu = statistics.median(p["cpu_us"] for p in runs)
        worker_cpu = statistics.median(p["worker_cpu_us"] for p in runs)
        print(
            f"{args.records} records, {args.partitions} partitions: bare consume+parse "
            f"{bare_rate:,.0f}/s, pipeline ({args.tiny} model, {name}) {pipe_rate:,.0f}/s, "
            f"ratio {pipe_rate / bare_rate:.2f} (target >= 0.5); start-up to first record "
            f"{startup:.1f}s (target <= 5); CPU a record: bare {bare_cpu:.1f} µs, pipeline "
            f"{cpu:.1f} µs (bare/pipeline {bare_cpu / cpu:.2f}), of which the worker process "
            f"{worker_cpu:.1f} µs (bare/worker {bare_cpu / worker_cpu:.2f})"
        )
        report["variants"][name] = {
            "pipeline": runs,
            "ratio": pipe_rate / bare_rate,
            "cpu_ratio": bare_cpu / cpu,
            "worker_cpu_ratio": bare_cpu / worker_cpu,
        }
        report.setdefault("pipeline", runs)
        report.setdefault("ratio", pipe_rate / bare_rate)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    broker.delete(kafka, [topic], [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
