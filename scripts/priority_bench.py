#!/usr/bin/env python3
"""Priority tiers: nearline latency while a large backfill is embedded, with tiers and without.

One run against the real broker. A backfill topic gets `--backfill` records (real
English paragraphs, published once and read by each variant's own group). Per variant,
a fresh nearline topic and a `pipeline run` worker on a fresh group and output:

    tiers      pipeline run --topic LIVE --backfill-topic CORPUS
    no-tiers   pipeline run --topic LIVE --topic CORPUS          (one tier, as before)

From the worker's first poll (model loaded, group joined) nearline records are
produced at `--rate` records/s, each stamped when sent, until the backfill is all
in the output (or `--max-seconds`). A record is visible when a published Parquet segment holding
it appears in the output (listed every 50 ms). The report, side by side: nearline
produce-to-visible p50/p99/max, the backfill's records/s (from the first poll to the
last backfill row visible) and seconds, how often backfill waited (tiers), and the
load average, since the machine may be shared.

    .venv/bin/python scripts/priority_bench.py [--backfill 50000] [--rate 20]
        [--variants tiers,no-tiers] [--model default] [--precision fp32]
        [--extra "--cache off"] [--max-seconds 1800] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import broker  # noqa: E402
from harness.numbers import pct  # noqa: E402
from harness.watchers import Visibility  # noqa: E402
from harness.worker import free_port, scrape  # noqa: E402

from pipeline.core.config import DEFAULT_BOOTSTRAP, KafkaSettings  # noqa: E402
from pipeline.core.corpus import sample_texts  # noqa: E402

READY_TIMEOUT_S = 180

VARIANTS = {
    "tiers": lambda live, corpus: ["--topic", live, "--backfill-topic", corpus],
    "no-tiers": lambda live, corpus: ["--topic", live, "--topic", corpus],
}


def texts_for(n: int, seed: int) -> list[str]:
    """`n` paragraphs; past the corpus's ~8,000, repeated with a suffix (distinct texts)."""
    base = sample_texts(n, seed)
    return [base[i % len(base)] + ("" if i < len(base) else f" ({i})") for i in range(n)]


def publish(
    kafka: KafkaSettings, topic: str, prefix: str, texts: list[str], partitions: int
) -> None:
    values = ({"id": f"{prefix}{n}", "text": text} for n, text in enumerate(texts))
    broker.publish(kafka, topic, values, partitions, acks=1)


def one_run(
    kafka: KafkaSettings, args: Any, name: str, corpus: str, backfill: int, work: Path
) -> dict[str, Any]:
    live = broker.new_topic(kafka, args.partitions, prefix="prio-live")
    output = work / name
    port = free_port()
    command = [
        sys.executable, "-m", "pipeline.cli", "--bootstrap-servers", kafka.bootstrap_servers,
        "run", *VARIANTS[name](live, corpus), "--group", f"prio-{name}-{uuid.uuid4().hex[:8]}",
        "--output", str(output), "--model", args.model, "--precision", args.precision,
        "--device", args.device, "--no-progress", "--metrics-port", str(port),
        *shlex.split(args.extra),
    ]  # fmt: skip
    log_path = work / f"{name}.log"
    log = open(log_path, "w")  # noqa: SIM115
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    worker = subprocess.Popen(command, stdout=log, stderr=log, env=env)
    load_before = os.getloadavg()
    pool = texts_for(2000, seed=11)
    sent: dict[str, float] = {}
    try:
        with Visibility(output) as visible:
            # The clock starts when the worker (model loaded, group joined) polls its first
            # record: from then on nearline records arrive while the backfill is embedded.
            deadline = time.monotonic() + READY_TIMEOUT_S
            while "first record polled" not in log_path.read_text():
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"priority_bench: worker {name} did not start; see {log.name}")
                time.sleep(0.1)
            started = time.time()
            from kafka import KafkaProducer

            producer = KafkaProducer(linger_ms=0, acks=1, **kafka.client_kwargs())
            began = time.monotonic()
            stop_at = began + args.max_seconds
            n, next_check = 0, 0.0
            while time.monotonic() < stop_at:
                if time.monotonic() >= next_check:  # every second: the backfill done?
                    next_check = time.monotonic() + 1.0
                    if sum(1 for i in list(visible.seen_at) if i.startswith("bf-")) >= backfill:
                        break
                delay = began + n / args.rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                record_id = f"nl-{n}"
                sent[record_id] = time.time()
                value = {"id": record_id, "text": pool[n % len(pool)]}
                producer.send(live, json.dumps(value).encode(), partition=n % args.partitions)
                n += 1
            producer.flush(timeout=60)
            producer.close(timeout=10)
            settle = time.monotonic() + args.settle
            while time.monotonic() < settle and not set(sent) <= set(visible.seen_at):
                time.sleep(0.1)
            seen = dict(visible.seen_at)
        metrics = scrape(port)
    finally:
        worker.terminate()
        worker.wait(timeout=120)
        log.close()
    load_after = os.getloadavg()
    latencies = sorted(seen[i] - t for i, t in sent.items() if i in seen)
    backfill_times = sorted(t for i, t in seen.items() if i.startswith("bf-"))
    span = backfill_times[-1] - started if backfill_times else None
    result = {
        "variant": name,
        "nearline_records": len(sent),
        "nearline_not_visible": len(sent) - len(latencies),
        "p50_s": pct(latencies, 50),
        "p99_s": pct(latencies, 99),
        "max_s": latencies[-1] if latencies else None,
        "backfill_visible": len(backfill_times),
        "backfill_seconds": span,
        "backfill_records_per_s": len(backfill_times) / span if span else None,
        "backfill_waits": metrics.get("pipeline_backfill_pauses_total"),
        "backfill_batch_records": metrics.get("pipeline_backfill_batch_records"),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in load_after],
    }
    broker.delete(kafka, [live, f"{live}.dlq"], [])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backfill", type=int, default=50_000)
    parser.add_argument("--rate", type=float, default=20.0, help="nearline records/s")
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--variants", default="tiers,no-tiers")
    parser.add_argument("--model", default="default")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--extra",
        default="--cache off",
        help="more worker flags for every variant (default: the cache off, since the "
        "nearline texts also occur in the backfill)",
    )
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="per variant")
    parser.add_argument("--settle", type=float, default=120.0, help="wait after the last send")
    parser.add_argument("--bootstrap-servers", default=DEFAULT_BOOTSTRAP)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    kafka = KafkaSettings(bootstrap_servers=args.bootstrap_servers)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    corpus = broker.new_topic(kafka, args.partitions, prefix="prio-corpus")
    started = time.monotonic()
    publish(kafka, corpus, "bf-", texts_for(args.backfill, seed=0), args.partitions)
    print(f"published {args.backfill} backfill records in {time.monotonic() - started:.1f}s")
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="priority-") as work:
            for name in names:
                result = one_run(kafka, args, name, corpus, args.backfill, Path(work))
                results.append(result)
                print(_line(result), flush=True)
    finally:
        broker.delete(kafka, [corpus], [])
    print(
        f"priority_bench: nearline {args.rate:g} records/s while {args.backfill:,} backfill "
        f"records are embedded ({args.model}, {args.precision}, {os.cpu_count()} CPUs)"
    )
    for result in results:
        print(_line(result))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _line(r: dict[str, Any]) -> str:
    def fmt(v: float | None, width: int = 6) -> str:
        return "-".rjust(width) if v is None else f"{v:{width}.2f}"

    rate = r["backfill_records_per_s"]
    return (
        f"  {r['variant']:<9} nearline p50 {fmt(r['p50_s'])}s p99 {fmt(r['p99_s'])}s "
        f"max {fmt(r['max_s'])}s ({r['nearline_records']} records, "
        f"{r['nearline_not_visible']} not visible) | backfill "
        f"{'-' if rate is None else f'{rate:,.1f}'} records/s, {r['backfill_visible']} in "
        f"{fmt(r['backfill_seconds'], 1)}s, waited {r['backfill_waits'] or 0:g}x | "
        f"load {r['load_before'][0]:.1f} -> {r['load_after'][0]:.1f}"
    )


if __name__ == "__main__":
    sys.exit(main())
