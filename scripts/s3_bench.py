"""The same bulk run written to a local directory and to `s3://`, side by side.

Publishes `--records` short texts to a fresh topic once, then runs
`pipeline run --until-end` on it with a fresh group per run, alternating the
output between a local directory and a prefix on the local S3-compatible server
(scripts/dev-s3.sh, started if needed), `--repeat` times each. Reports each
run's records/s from the worker's `done:` line (first record to last commit,
model load excluded) and the ratio s3 / local of the medians. With `--model
tiny` (a random 2-layer BERT: the model costs almost nothing) the output path
is what is measured; with the default model, what a user sees.

    .venv/bin/python scripts/s3_bench.py --records 20000
    .venv/bin/python scripts/s3_bench.py --records 20000 --model tiny --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import worker  # noqa: E402

from pipeline.core.config import DEFAULT_BOOTSTRAP, KafkaSettings  # noqa: E402

PIPELINE = [sys.executable, "-m", "pipeline.cli"]


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def s3_env() -> dict[str, str]:
    script = str(REPO / "scripts" / "dev-s3.sh")
    subprocess.run([script, "start"], check=True, stdout=subprocess.DEVNULL)
    printed = subprocess.run([script, "env"], capture_output=True, text=True, check=True)
    return dict(
        line.removeprefix("export ").split("=", 1)
        for line in printed.stdout.splitlines()
        if line.startswith("export ")
    )


def tiny_model(directory: Path) -> str:
    built = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "tiny_model.py"), str(directory)],
        capture_output=True,
        text=True,
        check=True,
    )
    return built.stdout.strip().splitlines()[-1]


def publish(topic: str, records: int, partitions: int, env: dict[str, str], work: Path) -> None:
    corpus = work / "corpus.jsonl"
    make_corpus = [sys.executable, str(REPO / "scripts" / "make_corpus.py")]
    subprocess.run(
        [*make_corpus, "--out", str(corpus), "--limit", str(records)],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    subprocess.run(
        [*PIPELINE, "topics", "create", topic, "--partitions", str(partitions)],
        check=True,
        env=env,
        capture_output=True,
    )
    subprocess.run(
        [*PIPELINE, "produce", topic, str(corpus), "--no-progress"],
        check=True,
        env=env,
        capture_output=True,
    )


def run_once(topic: str, output: str, model: str, env: dict[str, str]) -> dict[str, Any]:
    kafka = KafkaSettings(os.environ.get("PIPELINE_BOOTSTRAP_SERVERS", DEFAULT_BOOTSTRAP))
    group = f"s3bench-{uuid.uuid4().hex[:8]}"
    argv = worker.command(kafka, topic, group, output, "--model", model, "--precision", "fp32")
    outcome = worker.run(argv, env, timeout_s=3600)
    if outcome.done is None:
        raise SystemExit(f"worker failed ({outcome.returncode}):\n{outcome.stderr[-3000:]}")
    return {
        "output": output,
        "records": outcome.done.records,
        "records_per_s": outcome.done.rate,
        "wall_s": round(outcome.seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--model", default="default", help="a model, or 'tiny'")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    env = dict(os.environ, **s3_env(), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    bucket = os.environ.get("PIPELINE_S3_BUCKET", "pipeline-test")
    with tempfile.TemporaryDirectory(prefix="s3bench-") as tmp:
        work = Path(tmp)
        model = tiny_model(work / "tiny") if args.model == "tiny" else args.model
        topic = f"s3bench-{uuid.uuid4().hex[:8]}"
        say(f"publishing {args.records:,} records to {topic} ({args.partitions} partitions)")
        publish(topic, args.records, args.partitions, env, work)
        runs: dict[str, list[dict[str, Any]]] = {"local": [], "s3": []}
        for n in range(args.repeat):
            # Alternate which goes first, so neither always meets a warmer machine.
            order = ("local", "s3") if n % 2 == 0 else ("s3", "local")
            for kind in order:
                output = (
                    str(work / f"out-{n}")
                    if kind == "local"
                    else f"s3://{bucket}/s3bench-{uuid.uuid4().hex[:8]}"
                )
                result = run_once(topic, output, model, env)
                runs[kind].append(result)
                say(f"{kind:5s} run {n + 1}: {result['records_per_s']:,.0f} records/s")
    medians = {k: statistics.median(r["records_per_s"] for r in v) for k, v in runs.items()}
    report = {
        "records": args.records,
        "partitions": args.partitions,
        "model": args.model,
        "load_1min": os.getloadavg()[0],
        "runs": runs,
        "median_records_per_s": medians,
        "ratio_s3_over_local": round(medians["s3"] / medians["local"], 3),
    }
    print(
        f"local {medians['local']:,.0f} records/s, s3 {medians['s3']:,.0f} records/s, "
        f"ratio s3/local {report['ratio_s3_over_local']:.2f} "
        f"(medians of {args.repeat}; model {args.model}; load {report['load_1min']:.1f})"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
