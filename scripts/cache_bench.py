#!/usr/bin/env python3
"""The embedding cache by content, measured: records/s with it against without.

One run, real text (standard-library paragraphs, `pipeline.core.corpus`), published once
to a fresh topic, in which `--repeat-share` of the records (30 % by default) repeat
the exact text of an earlier record, spread at random over the topic. Two groups:

  1. in-process LRU: `pipeline run --until-end --cache off` against `--cache lru`,
     each on a fresh group and output, alternating for `--rounds` rounds; the
     medians of the worker's steady rate (its `done:` line: first record to last
     commit) side by side, as a ratio. Only the distinct texts reach the model, so
     the ratio tends to 1 / (1 - share) (1.43 at 30 %) less what the rest of the
     path costs (Kafka, tokenizing every record, Parquet).
  2. shared Redis (`--redis`, default the local scripts/dev-redis.sh server, database
     15, flushed first): a first group embeds the topic with `--cache redis://...`
     (a cold Redis: the repeats hit, the rest is written), then a second group
     re-embeds the same topic into a fresh output with a fresh process (an empty LRU):
     every record comes from Redis. Hit rate and records/s of both.

It also checks that the outputs agree: the same rows, and vectors within fp32's last
bits of the cache-off run's (`max |delta|`).

    .venv/bin/python scripts/cache_bench.py [--records 3000] [--repeat-share 0.3]
        [--rounds 3] [--precision fp32] [--model default] [--batch-size 512]
        [--partitions 3] [--redis URL | --no-redis] [--json FILE] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import HarnessError, broker, worker
from harness.corpora import paragraphs
from harness.numbers import load_note

from pipeline.core.config import DEFAULT_BOOTSTRAP, KafkaSettings

REPO = Path(__file__).resolve().parents[1]
_CACHE_RE = re.compile(r"; cache: (?P<hits>\d+) of (?P<lookups>\d+) records from the cache")
_REDIS_RE = re.compile(r"(?P<redis>\d+) redis, (?P<errors>\d+) redis errors")


@dataclass
class Run:
    variant: str
    group: str
    records: int
    steady_per_s: float
    wall_s: float
    hits: int | None
    hit_rate: float | None
    redis_hits: int | None
    redis_errors: int | None
    done_line: str


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--records", type=int, default=3000)
    p.add_argument("--repeat-share", type=float, default=0.3)
    p.add_argument("--rounds", type=int, default=3, help="off/lru pairs, alternating")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--device", default="auto")
    p.add_argument("--model", default="default")
    # Smaller than the worker's default, so that repeats fall in other batches too (the
    # LRU's case, and a nearline worker's) as well as in their own.
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--partitions", type=int, default=3)
    p.add_argument(
        "--bootstrap-servers",
        default=os.environ.get("PIPELINE_BOOTSTRAP_SERVERS", DEFAULT_BOOTSTRAP),
    )
    p.add_argument("--redis", default=None, help="[default: scripts/dev-redis.sh, database 15]")
    p.add_argument("--no-redis", action="store_true", help="skip the shared-Redis group")
    p.add_argument("--timeout", type=float, default=1800, help="per worker run, seconds")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the outputs and logs")
    args = p.parse_args(argv)
    if not 0 <= args.repeat_share < 1:
        p.error("--repeat-share is in [0, 1)")
    return args


def say(message: str) -> None:
    print(f"cache_bench: {message}", file=sys.stderr, flush=True)


def corpus(n: int, share: float, seed: int = 7) -> tuple[list[str], int]:
    """n texts of which round(share * n) repeat an earlier one exactly; (texts, repeats)."""
    rng = np.random.default_rng(seed)
    repeats = round(share * n)
    distinct = paragraphs(n - repeats)
    repeat_at = set(rng.choice(np.arange(1, n), size=repeats, replace=False).tolist())
    texts: list[str] = []
    seen = 0
    for i in range(n):
        if i in repeat_at:
            texts.append(distinct[int(rng.integers(seen))])
        else:
            texts.append(distinct[seen])
            seen += 1
    return texts, repeats


def run_worker(
    args: argparse.Namespace, topic: str, variant: str, cache: str, workdir: Path
) -> Run:
    group = f"cache-bench-{variant}-{uuid.uuid4().hex[:8]}"
    output = workdir / group
    kafka = KafkaSettings(bootstrap_servers=args.bootstrap_servers)
    flags = ["--batch-size", str(args.batch_size), "--precision", args.precision]
    flags += ["--device", args.device, "--model", args.model, "--cache", cache]
    argv = worker.command(kafka, topic, group, output, *flags)
    outcome = worker.run(argv, timeout_s=args.timeout, log=workdir / f"{group}.log")
    if outcome.done is None:
        tail = outcome.stderr[-3000:]
        raise HarnessError(f"{variant}: `pipeline run` exited {outcome.returncode}:\n{tail}")
    line, records, rate, wall = (
        outcome.done.line,
        outcome.done.records,
        outcome.done.rate,
        outcome.seconds,
    )
    if records != args.records:
        raise HarnessError(f"{variant}: {records} records, expected {args.records}: {line}")
    cached = _CACHE_RE.search(line)
    remote = _REDIS_RE.search(line)
    hits = int(cached["hits"]) if cached else None
    run = Run(
        variant=variant,
        group=group,
        records=records,
        steady_per_s=rate,
        wall_s=wall,
        hits=hits,
        hit_rate=hits / int(cached["lookups"]) if cached else None,
        redis_hits=int(remote["redis"]) if remote else None,
        redis_errors=int(remote["errors"]) if remote else None,
        done_line=line,
    )
    hit = f", {run.hit_rate:.1%} from the cache" if run.hit_rate is not None else ""
    say(f"  {variant:<12} {rate:8.1f} records/s (steady), {wall:6.1f}s wall{hit}")
    return run


def vectors(output: Path) -> tuple[list[dict], np.ndarray]:
    """Every row's columns but the vector, and the vectors, in (partition, offset) order."""
    table = ds.dataset(output / "vectors").to_table()
    table = table.sort_by([("partition", "ascending"), ("offset", "ascending")])
    matrix = np.array(table["embedding"].to_pylist(), dtype=np.float32)
    return table.drop_columns(["embedding"]).to_pylist(), matrix


def redis_url(args: argparse.Namespace) -> str:
    if args.redis:
        return args.redis
    script = REPO / "scripts" / "dev-redis.sh"
    subprocess.run([str(script), "start"], check=True, stdout=subprocess.DEVNULL)
    url = subprocess.run([str(script), "url"], check=True, capture_output=True, text=True)
    return url.stdout.strip().rsplit("/", 1)[0] + "/15"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kafka = KafkaSettings(bootstrap_servers=args.bootstrap_servers)
    workdir = Path(tempfile.mkdtemp(prefix="cache-bench-"))
    texts, repeats = corpus(args.records, args.repeat_share)
    ids = [f"cache-bench-{i:06d}" for i in range(args.records)]
    topic = broker.new_topic(kafka, args.partitions, prefix="cache-bench")
    say(
        f"topic {topic}: {args.records} records, {repeats} repeating an earlier text "
        f"({repeats / args.records:.0%}); model {args.model} {args.precision}; "
        f"batch size {args.batch_size}; {os.cpu_count()} CPUs {load_note()}"
    )
    records = ({"id": i, "text": t} for i, t in zip(ids, texts, strict=True))
    broker.publish(kafka, topic, records, args.partitions)
    runs: list[Run] = []
    try:
        say("group 1: in-process LRU, alternating")
        for _ in range(args.rounds):
            runs.append(run_worker(args, topic, "off", "off", workdir))
            runs.append(run_worker(args, topic, "lru", "lru", workdir))
        remote_runs: list[Run] = []
        redis_info: dict[str, int] = {}
        if not args.no_redis:
            import redis

            url = redis_url(args)
            client = redis.Redis.from_url(url)
            client.flushdb()
            say(f"group 2: shared Redis at {url} (flushed)")
            remote_runs.append(run_worker(args, topic, "redis-cold", url, workdir))
            remote_runs.append(run_worker(args, topic, "redis-warm", url, workdir))
            memory = client.info("memory")
            redis_info = {"keys": client.dbsize(), "used_memory": int(memory["used_memory"])}
            client.close()
        report = summarise(args, repeats, runs, remote_runs, redis_info, workdir)
    finally:
        broker.delete(kafka, [topic, f"{topic}.dlq"], [r.group for r in runs])
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            say(f"outputs and logs kept in {workdir}")
    print(report["text"])
    if args.json:
        args.json.write_text(json.dumps({k: v for k, v in report.items() if k != "text"}, indent=2))
    return 0


def summarise(
    args: argparse.Namespace,
    repeats: int,
    runs: list[Run],
    remote_runs: list[Run],
    redis_info: dict[str, int],
    workdir: Path,
) -> dict:
    off = [r for r in runs if r.variant == "off"]
    lru = [r for r in runs if r.variant == "lru"]
    off_rate = statistics.median(r.steady_per_s for r in off)
    lru_rate = statistics.median(r.steady_per_s for r in lru)
    off_wall = statistics.median(r.wall_s for r in off)
    lru_wall = statistics.median(r.wall_s for r in lru)
    rows_off, base = vectors(workdir / off[0].group)
    drift = {}
    for run in [lru[0], *remote_runs]:
        rows, matrix = vectors(workdir / run.group)
        if rows != rows_off:
            raise HarnessError(f"{run.variant}: the rows differ from the cache-off run's")
        drift[run.variant] = float(np.abs(matrix - base).max())
    ideal = 1 / (1 - repeats / args.records)
    lines = [
        "",
        f"{args.records} records, {repeats} repeats ({repeats / args.records:.0%}), "
        f"model {args.model} {args.precision}, batch size {args.batch_size}, "
        f"{args.rounds} round(s) of off/lru",
        "",
        f"{'variant':<34}{'records/s':>10}{'wall s':>9}{'from cache':>12}",
        f"{'--cache off (median)':<34}{off_rate:>10.1f}{off_wall:>9.1f}{'-':>12}",
        f"{'--cache lru (median)':<34}{lru_rate:>10.1f}{lru_wall:>9.1f}"
        f"{statistics.median(r.hit_rate or 0 for r in lru):>12.1%}",
    ]
    for run in remote_runs:
        label = {
            "redis-cold": "--cache redis, 1st group (cold)",
            "redis-warm": "--cache redis, 2nd group (warm)",
        }[run.variant]
        lines.append(
            f"{label:<34}{run.steady_per_s:>10.1f}{run.wall_s:>9.1f}{run.hit_rate or 0:>12.1%}"
        )
    lines += [
        "",
        f"ratio lru/off: {lru_rate / off_rate:.2f} steady, {off_wall / lru_wall:.2f} wall "
        f"(model work alone: 1/(1-{repeats / args.records:.2f}) = {ideal:.2f})",
        "  off rounds: " + ", ".join(f"{r.steady_per_s:.1f}" for r in off),
        "  lru rounds: " + ", ".join(f"{r.steady_per_s:.1f}" for r in lru),
    ]
    for run in remote_runs:
        lines.append(
            f"ratio {run.variant}/off: {run.steady_per_s / off_rate:.2f} steady; "
            f"{run.redis_hits} from Redis, {run.redis_errors} Redis errors"
        )
    if redis_info:
        lines.append(
            f"Redis after both: {redis_info['keys']} keys, "
            f"{redis_info['used_memory'] / 2**20:.1f} MiB used"
        )
    lines.append(
        "rows identical to --cache off in every column; vectors max |delta|: "
        + ", ".join(f"{k} {v:.1e}" for k, v in drift.items())
    )
    return {
        "setup": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "repeats": repeats,
        "runs": [asdict(r) for r in [*runs, *remote_runs]],
        "off_per_s": off_rate,
        "lru_per_s": lru_rate,
        "ratio_lru_off": lru_rate / off_rate,
        "ideal_ratio": ideal,
        "redis": redis_info,
        "max_abs_delta": drift,
        "text": "\n".join(lines),
    }


if __name__ == "__main__":
    try:
        sys.exit(main())
    except HarnessError as exc:
        print(f"cache_bench: {exc}", file=sys.stderr)
        sys.exit(1)
