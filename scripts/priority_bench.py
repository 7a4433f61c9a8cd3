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
last backfill row visible) and seconds, how often backfill waited (tiers), the
longest time any backfill partition went without a row becoming visible while it
still had records (fair backfill: every partition advances), and the load average,
since the machine may be shared.

`--busy 0,1` runs every variant on a quiet host and again beside that many processes
each keeping a core busy (a squeezed CPU), side by side in the one report.

    .venv/bin/python scripts/priority_bench.py [--backfill 50000] [--rate 20]
        [--variants tiers,no-tiers] [--busy 0] [--model default] [--precision fp32]
        [--extra "--cache off"] [--max-seconds 1800] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
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
from harness.worker import Busy, free_port, scrape  # noqa: E402

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


def partition_stalls(
    seen: dict[str, float], backfill: int, partitions: int, started: float, ended: float
) -> dict[str, list[Any]]:
    """Per backfill partition (record n went to partition n % partitions): rows visible,
    and the longest time without a new row while the partition still had records to
    give (from the first poll to its last row, or to the end of the run)."""
    times: list[list[float]] = [[] for _ in range(partitions)]
    for record_id, at in seen.items():
        if record_id.startswith("bf-"):
            n = int(record_id[3:])
            times[n % partitions].append(at)
    total = [len(range(p, backfill, partitions)) for p in range(partitions)]
    stall_s = []
    for p, ats in enumerate(times):
        ats.sort()
        # Visibility comes a segment at a time: gaps between distinct arrival times.
        points = [started, *sorted(set(ats))]
        if len(ats) < total[p]:
            points.append(ended)  # still records to give when the run ended
        stall_s.append(max(b - a for a, b in itertools.pairwise(points)))
    return {"rows": [len(ats) for ats in times], "stall_s": stall_s}


def one_run(
    kafka: KafkaSettings,
    args: Any,
    name: str,
    corpus: str,
    backfill: int,
    work: Path,
    busy: int = 0,
) -> dict[str, Any]:
    live = broker.new_topic(kafka, args.partitions, prefix="prio-live")
    output = work / f"{name}-busy{busy}"
    port = free_port()
    command = [
        sys.executable, "-m", "pipeline.cli", "--bootstrap-servers", kafka.bootstrap_servers,
        "run", *VARIANTS[name](live, corpus), "--group", f"prio-{name}-{uuid.uuid4().hex[:8]}",
        "--output", str(output), "--model", args.model, "--precision", args.precision,
        "--device", args.device, "--no-progress", "--metrics-port", str(port),
        *shlex.split(args.extra),
    ]  # fmt: skip
    log_path = work / f"{name}-busy{busy}.log"
    log = open(log_path, "w")  # noqa: SIM115
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    load_before = os.getloadavg()
    squeeze = Busy(busy).__enter__()
    worker = subprocess.Popen(command, stdout=log, stderr=log, env=env)
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
        load_after = os.getloadavg()
        squeeze.__exit__(None, None, None)
        log.close()
    latencies = sorted(seen[i] - t for i, t in sent.items() if i in seen)
    backfill_times = sorted(t for i, t in seen.items() if i.startswith("bf-"))
    span = backfill_times[-1] - started if backfill_times else None
    stalls = partition_stalls(seen, backfill, args.partitions, started, time.time())
    result = {
        "variant": name,
        "busy": busy,
        "nearline_records": len(sent),
        "nearline_not_visible": len(sent) - len(latencies),
        "p50_s": pct(latencies, 50),
        "p99_s": pct(latencies, 99),
        "max_s": latencies[-1] if latencies else None,
        "backfill_visible": len(backfill_times),
        "backfill_seconds": span,
        "backfill_records_per_s": len(backfill_times) / span if span else None,
        "backfill_waits": metrics.get("pipeline_backfill_pauses_total"),
        "backfill_partition_rows": stalls["rows"],
        "backfill_longest_stall_s": max(stalls["stall_s"]) if stalls["stall_s"] else None,
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
    parser.add_argument(
        "--busy",
        default="0",
        help="comma-separated counts of busy processes (each spinning one core) to run "
        "every variant beside, e.g. 0,1",
    )
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
            for busy in [int(b) for b in args.busy.split(",") if b]:
                for name in names:
                    result = one_run(kafka, args, name, corpus, args.backfill, Path(work), busy)
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
    stall = r["backfill_longest_stall_s"]
    return (
        f"  {r['variant']:<9} busy {r['busy']} nearline p50 {fmt(r['p50_s'])}s "
        f"p99 {fmt(r['p99_s'])}s "
        f"max {fmt(r['max_s'])}s ({r['nearline_records']} records, "
        f"{r['nearline_not_visible']} not visible) | backfill "
        f"{'-' if rate is None else f'{rate:,.1f}'} records/s, {r['backfill_visible']} in "
        f"{fmt(r['backfill_seconds'], 1)}s, waited {r['backfill_waits'] or 0:g}x, "
        f"rows per partition {r['backfill_partition_rows']}, longest partition stall "
        f"{fmt(stall, 1)}s | "
        f"load {r['load_before'][0]:.1f} -> {r['load_after'][0]:.1f}"
    )


if __name__ == "__main__":
    sys.exit(main())
