#!/usr/bin/env python3
"""Throughput benchmark: the pipeline against what a user would otherwise write.

One run, the same records of real text (standard-library docstring paragraphs,
`pipeline.core.corpus.sample_texts`), published once to a fresh topic, four variants:

  (a) the raw model: `Embedder.tokenize` + `embed_tokens` at the pipeline's precision,
      all texts sorted at once and cut into passes under the token budget; no Kafka,
      no I/O; in a fresh process, as (d) is;
  (b) sentence-transformers `encode(texts, batch_size=32)` at fp32;
  (c) a naive consumer: kafka-python, polls of 32, each batch embedded in arrival order
      at fp32 with plain transformers (padding per batch, mean pooling, L2), one Parquet
      file and one commit per batch, until every record is consumed;
  (d) `pipeline run --until-end` as a subprocess on a fresh group and output directory:
      process start to exit, and the worker's steady-state rate from its final stderr
      line `done: N records (...) in B batches, S s, R records/s` (timed after model load).

Beside (b), the peers a user could pick instead (scripts/harness/peers.py): torch bf16,
ONNX Runtime fp32 and dynamic int8, OpenVINO fp32 and NNCF static int8, each with its
gate figures against (b)'s vectors; "best": the fastest (b included) that passes.

It then prints the ratios d/a, d/b, d/c, d/best beside their targets, where (d)'s
time goes (its stages and CPU; (a)'s tokenizing and forward passes), the padding
efficiency of (d)'s batching and of (c)'s, and the quality of the vectors (d) stored
against fp32: cosine mean and minimum, recall@10, PASS/FAIL on the precision gate.
(b) and (c) run with one torch thread count (--threads); (a) with the worker's own
layout of model replicas x threads (pipeline.core.host.plan_cpu), as (d) does.

    .venv/bin/python scripts/bench.py [--records 3000] [--precision auto] [--device auto]
        [--batch-size 4096] [--partitions 3] [--repeat 1] [--json results.json] [--keep]
        [--no-peers]

Each of (a) to (c) loads its model and runs on one fresh thread, as `pipeline run`
loads its model on a thread that exits and embeds on its embed-stage thread: one
OpenMP team at a time, so none pays throttled spin-waits (see pipeline.core.host).
(a) runs in a process of its own: the bench process has warmed its heap on (b) and (c),
which made (a) 5-10% faster than any fresh process could be. (d) logs to `run-N.log`
in the temp dir (kept with --keep). With --repeat N, (a) and (d) run N rounds,
alternating (the speed of the machine drifts), and the ratios use their medians; so
does "best": the peers that pass the gate within 15 % of the fastest are timed again
in each round, between (a) and (d), and their medians pick it.
A 3000-record run on CPU takes several minutes. Exits 0 once everything was measured,
whether or not the targets were met; 1 when a variant failed (or (d) passed --timeout).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from harness import HarnessError, broker, worker
from harness.auto import resolved
from harness.baselines import (
    WARMUP_TEXTS,
    NaiveModel,
    bench_naive,
    bench_sentence_transformers,
)
from harness.corpora import paragraphs as make_texts
from harness.numbers import Padding, Rate, Timer, load_note, median_by
from harness.peers import (
    Peer,
    at_median,
    best,
    contenders,
    measure_peers,
    reference_peer,
    render_peers,
)
from harness.quality import Quality, quality, render_quality
from harness.shares import render_shares, time_spent

from pipeline.core.config import DEFAULT_BOOTSTRAP, DEVICES, PRECISIONS, KafkaSettings, WorkerConfig
from pipeline.core.errors import PipelineError
from pipeline.core.host import call_on_fresh_thread
from pipeline.model.embedder import Embedder, pick_device
from pipeline.model.precision import (
    DEFAULT_MIN_COSINE,
    DEFAULT_MIN_RECALL,
)
from pipeline.model.spec import resolve_model_path

T = TypeVar("T")
RATIO_TARGETS = {"d/a": 0.90, "d/b": 2.0, "d/c": 4.0, "d/best": 2.0}
PADDING_TARGET = 0.90


@dataclass
class Results:
    setup: dict[str, Any]
    rates: list[Rate] = field(default_factory=list)
    padding: list[Padding] = field(default_factory=list)
    quality: Quality | None = None
    peers: list[Peer] = field(default_factory=list)
    # (a)'s seconds tokenizing and in forward passes, (d)'s time in stages and CPU.
    shares: dict[str, float] = field(default_factory=dict)

    def rate(self, key: str) -> float:
        if key == "best":
            return self.best_peer().rate.per_s if self.peers else float("nan")
        return next(r.per_s for r in self.rates if r.key == key)

    def best_peer(self) -> Peer:
        return best(self.peers)

    def ratios(self) -> dict[str, dict[str, float]]:
        steady, wall = self.rate("d_steady"), self.rate("d_wall")
        out = {}
        for name in RATIO_TARGETS:
            base = self.rate(name.split("/")[1])
            out[name] = {"steady": _div(steady, base), "wall": _div(wall, base)}
        return out

    def as_json(self) -> dict[str, Any]:
        return {
            "setup": self.setup,
            "rates": {r.key: asdict(r) for r in self.rates},
            "ratios": self.ratios(),
            "ratio_targets": RATIO_TARGETS,
            "padding": [asdict(p) | {"efficiency": p.efficiency} for p in self.padding],
            "quality": asdict(self.quality) | {"passed": self.quality.passed}
            if self.quality
            else None,
            "gate": {"min_cosine_mean": DEFAULT_MIN_COSINE, "min_recall_at_10": DEFAULT_MIN_RECALL},
            "peers": [asdict(p) | {"passed": p.passed} for p in self.peers],
            "best_peer": self.best_peer().rate.key if self.peers else None,
            "shares": self.shares,
        }


BenchError = HarnessError


def _div(a: float, b: float) -> float:
    return a / b if b else float("nan")


def say(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


# -- arguments and inputs ---------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Embedding throughput: raw model, sentence-transformers, a naive "
        "Kafka consumer and `pipeline run`, on the same records."
    )
    parser.add_argument("--records", type=int, default=3000, help="records to embed")
    parser.add_argument("--precision", choices=PRECISIONS, default="auto")
    parser.add_argument("--device", choices=DEVICES, default="auto")
    parser.add_argument("--model", default="default", help="as `pipeline run --model`")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=WorkerConfig.default_of("batch_size"),
        help="(d)'s --batch-size (default: pipeline run's)",
    )
    parser.add_argument("--partitions", type=int, default=3, help="of the fresh topic")
    parser.add_argument(
        "--bootstrap-servers",
        default=os.environ.get("PIPELINE_BOOTSTRAP_SERVERS", DEFAULT_BOOTSTRAP),
    )
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument(
        "--keep", action="store_true", help="keep the temp dir (printed), the topic and the groups"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads for (b) and (c) (default: all cores; (a) and (d) use the "
        "worker's replicas x threads)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of (a) then (d); their medians make the ratios (rates drift on a "
        "shared machine)",
    )
    parser.add_argument(
        "--no-peers",
        dest="peers",
        action="store_false",
        help="skip the peers beside (b) (bf16, ONNX, OpenVINO): minutes less",
    )
    parser.add_argument("--raw-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds (d) may take before it is killed"
    )
    args = parser.parse_args(argv)
    for name in ("records", "batch_size", "partitions", "threads", "repeat"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


def make_ids(n: int) -> list[str]:
    return [f"bench-{i:06d}" for i in range(n)]


def quiet_libraries() -> None:
    """Progress bars and warnings of libraries would be mixed into the report."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # failures surface as errors


def describe_hardware(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    from pipeline.model.precision import cpu_model

    return f"{cpu_model()}, {os.cpu_count()} cores"


# -- Kafka ----------------------------------------------------------------------------


# -- (a) raw model and (b) sentence-transformers ---------------------------------------


def bench_raw(embedder: Embedder, texts: list[str]) -> tuple[float, float]:
    """Seconds to tokenize texts and to embed them, after a warm-up on a few."""
    embedder.embed_tokens(embedder.tokenize(texts[:WARMUP_TEXTS]))
    started = time.perf_counter()
    tokens = embedder.tokenize(texts)
    tokenized = time.perf_counter()
    embedder.embed_tokens(tokens)
    return tokenized - started, time.perf_counter() - tokenized


def bench_raw_in_fresh_process(
    args: argparse.Namespace, precision: str, device: str
) -> tuple[Rate, float]:
    """(a) in a process of its own, started like (d)'s: no state left by (b) and (c).

    The bench process has by then grown its heap and warmed its caches on two
    other models, which (a) measured here would inherit and (d) cannot.
    """
    options = {
        "--records": str(args.records),
        "--precision": precision,
        "--device": device,
        "--model": args.model,
        "--threads": str(args.threads),
    }
    command = [sys.executable, str(Path(__file__).resolve()), "--raw-only"]
    command += [word for pair in options.items() for word in pair]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")  # as `pipeline run` sets it
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
    if proc.returncode != 0:
        raise BenchError(f"(a) exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    timed = json.loads(proc.stdout.strip().splitlines()[-1])
    seconds = float(timed["tokenize"]) + float(timed["embed"])
    name = f"(a) raw model: Embedder {precision}, length-sorted passes"
    return Rate.timed("a", name, args.records, seconds), float(timed["tokenize"]) / seconds


def raw_only(args: argparse.Namespace) -> int:
    """The child side of bench_raw_in_fresh_process: prints {"tokenize": S, "embed": S}."""
    import torch

    from pipeline.core.host import plan_cpu, usable_cpus

    # The raw model at the layout `pipeline run` gives it (replicas x threads).
    plan = plan_cpu(pick_device(args.device), usable_cpus())
    torch.set_num_threads(plan.threads_per_replica)
    texts = make_texts(args.records)

    def load_and_time() -> tuple[float, float]:
        embedder = Embedder.load_planned(args.model, args.precision, plan)
        return bench_raw(embedder, texts)

    tokenize, embed = call_on_fresh_thread(load_and_time)
    print(json.dumps({"tokenize": tokenize, "embed": embed}), flush=True)
    return 0


@dataclass(frozen=True)
class PipelineRun:
    wall: Rate
    steady: Rate
    batches: int
    done_line: str


def bench_pipeline(
    args: argparse.Namespace, setup: dict[str, Any], group: str, output: Path, log_path: Path
) -> PipelineRun:
    """Runs (d) with its stderr in log_path (kept with --keep); times start to exit."""
    flags = ["--batch-size", str(args.batch_size), "--precision", setup["precision"]]
    flags += ["--device", setup["device"], "--model", args.model]
    kafka = KafkaSettings(bootstrap_servers=args.bootstrap_servers)
    argv = worker.command(kafka, setup["topic"], group, output, *flags)
    outcome = worker.run(argv, timeout_s=args.timeout, log=log_path)
    if outcome.done is None:
        raise BenchError(
            f"(d) `pipeline run` exited {outcome.returncode}:\n{outcome.stderr[-3000:]}"
        )
    done, wall = outcome.done, outcome.seconds
    line, records, batches, seconds, rate = (
        done.line,
        done.records,
        done.batches,
        done.seconds,
        done.rate,
    )
    if records != setup["records"]:
        raise BenchError(f"(d) processed {records} records: {line}")
    return PipelineRun(
        wall=Rate.timed(
            "d_wall", "(d) pipeline run --until-end: process start to exit", records, wall
        ),
        steady=Rate(
            "d_steady",
            "(d) pipeline run: steady state (worker's done: line)",
            records,
            seconds,
            rate,
        ),
        batches=batches,
        done_line=line,
    )


# -- padding and quality --------------------------------------------------------------


def policy_tokens(embedder: Embedder, lengths: np.ndarray) -> tuple[int, int]:
    """(real, computed) tokens of the embedder's sorted sub-batches over these lengths."""
    ordered = np.sort(lengths, kind="stable")
    passes = embedder.shape_plan.plan(ordered)
    return int(ordered.sum()), sum(p.computed_tokens for p in passes)


def policy_padding(embedder: Embedder, lengths: np.ndarray, batch_size: int) -> list[Padding]:
    """(d)'s policy over the whole run sorted at once, and per micro-batch of batch_size."""
    whole = Padding(
        "(d) policy: all texts sorted, cut by ShapePlan",
        *policy_tokens(embedder, lengths),
        target=PADDING_TARGET,
    )
    real = computed = 0
    for start in range(0, len(lengths), batch_size):
        r, c = policy_tokens(embedder, lengths[start : start + batch_size])
        real, computed = real + r, computed + c
    per_batch = Padding(
        f"(d) policy: per micro-batch of {batch_size}, publish order", real, computed
    )
    return [whole, per_batch]


# -- the report -----------------------------------------------------------------------


def render(results: Results) -> str:
    s = results.setup
    lines = [
        f"{s['records']} records ({s['text']}; median {s['median_chars']} chars, "
        f"{s['median_tokens']} tokens), model {s['model']}",
        f"device {s['device']} ({s['hardware']}), precision {s['precision']} "
        f"({s['precision_source']}), torch threads {s['torch_threads']} for (b)-(c), "
        f"(d) --batch-size {s['batch_size']}, {s['partitions']} partitions",
        "",
        f"{'variant':<66}{'texts/s':>10}{'seconds':>10}",
    ]
    lines += [f"{r.name:<66}{r.per_s:>10.1f}{r.seconds:>10.2f}" for r in results.rates]
    rounds = s.get("rounds", {})
    if len(rounds.get("a", [])) > 1:
        for key, label in (("a", "(a)"), ("d_steady", "(d) steady"), ("d_wall", "(d) wall")):
            values = ", ".join(f"{v:.1f}" for v in rounds[key])
            lines.append(f"  {label} in {len(rounds[key])} rounds: {values}")
        lines.append("  above: the median (a), and the (d) run with the median steady rate")
    lines += ["", f"{'ratio':<8}{'steady':>8}{'wall':>8}   target   (steady: (d) after model load)"]
    for name, values in results.ratios().items():
        target = RATIO_TARGETS[name]
        verdict = "ok" if values["steady"] >= target else "MISSED"
        lines.append(
            f"{name:<8}{values['steady']:>8.2f}{values['wall']:>8.2f}   >= {target:<5.2f} {verdict}"
        )
    if len(results.peers) > 1:
        lines += ["", *render_peers(results.peers)]
    if results.shares:
        lines += ["", *render_shares(results.shares)]
    lines += ["", f"{'padding efficiency (real / computed tokens)':<66}{'value':>10}   target"]
    for p in results.padding:
        target = (
            ""
            if p.target is None
            else f"   >= {p.target:.2f} " + ("ok" if p.efficiency >= p.target else "MISSED")
        )
        lines.append(f"{p.label:<66}{p.efficiency:>10.3f}{target}")
    if results.quality is not None:
        lines += ["", *render_quality(results.quality, s["precision"])]
    if s.get("load_before"):
        lines += ["", f"NOTE: {s['load_before']} at start; rates are unreliable"]
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------


def describe_setup(
    args: argparse.Namespace,
    texts: list[str],
    lengths: np.ndarray,
    device: str,
    precision: str,
    threads: int,
    model_name: str,
) -> dict[str, Any]:
    return {
        "records": len(texts),
        "text": "stdlib docstring paragraphs from pipeline.core.corpus.sample_texts",
        "median_chars": int(np.median([len(t) for t in texts])),
        "median_tokens": int(np.median(lengths)),
        "model": model_name,
        "device": device,
        "hardware": describe_hardware(device),
        "precision": precision,
        "precision_source": "auto" if args.precision == "auto" else "--precision",
        "torch_threads": threads,
        "batch_size": args.batch_size,
        "partitions": args.partitions,
        "bootstrap_servers": args.bootstrap_servers,
    }


def run_all(args: argparse.Namespace, workdir: Path, kafka: KafkaSettings) -> Results:
    import torch

    torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    setup_note = load_note()
    # No torch work on this thread: each variant's OpenMP team comes and goes with
    # the fresh thread it runs on (see pipeline.core.host).
    # auto resolved in a child (harness.auto): measuring here slowed the torch peers.
    device, precision = resolved(args.model, args.device, args.precision, args.timeout)
    model_name, model_dir = resolve_model_path(args.model)
    texts, ids = make_texts(args.records), make_ids(args.records)
    embedder = call_on_fresh_thread(lambda: Embedder.load(args.model, precision, device))
    lengths = embedder.tokenize(texts).lengths
    setup = describe_setup(args, texts, lengths, device, precision, threads, model_name)
    setup["load_before"] = setup_note
    results = Results(setup)

    topic = broker.new_topic(kafka, args.partitions)
    groups = [f"{topic}-naive", *(f"{topic}-pipeline-{n}" for n in range(args.repeat))]
    setup |= {"topic": topic, "groups": groups, "workdir": str(workdir)}
    try:
        say(f"publishing {len(texts)} records to {topic} ({args.partitions} partitions)")
        records = ({"id": i, "text": t} for i, t in zip(ids, texts, strict=True))
        broker.publish(kafka, topic, records, args.partitions)
        measure(args, results, embedder, texts, ids, model_dir, kafka, workdir)
    finally:
        if not args.keep:
            broker.delete(kafka, [topic, f"{topic}.dlq"], groups)
    return results


def measure(
    args: argparse.Namespace,
    results: Results,
    embedder: Embedder,
    texts: list[str],
    ids: list[str],
    model_dir: Path,
    kafka: KafkaSettings,
    workdir: Path,
) -> None:
    setup = results.setup
    topic, (naive_group, *pipeline_groups) = setup["topic"], setup["groups"]
    say("(b) sentence-transformers")
    rate_b, reference, timer_b = call_on_fresh_thread(
        lambda: bench_sentence_transformers(model_dir, setup["device"], texts)
    )
    say("(c) naive consumer")
    warmup = texts[:WARMUP_TEXTS]
    rate_c, naive_padding = call_on_fresh_thread(
        lambda: bench_naive(
            kafka,
            topic,
            naive_group,
            NaiveModel(model_dir, setup["device"]),
            len(texts),
            workdir / "naive",
            warmup,
        )
    )
    measured: list[tuple[Peer, Timer]] = [(reference_peer(rate_b), timer_b)]
    if args.peers and setup["device"] == "cpu":
        measured += measure_peers(model_dir, texts, reference, workdir, args.threads, say)
    # With rounds, "best" is a median too: its contenders run again in each round.
    results.peers = [peer for peer, _ in measured]
    retimed = contenders(measured) if args.repeat > 1 else []
    del measured  # the other peers' models: not held through the rounds
    rates_a, tokenize_shares, runs, peer_rounds = run_rounds(
        args, setup, pipeline_groups, workdir, retimed
    )
    results.peers = [at_median(p, peer_rounds.get(p.rate.key, [])) for p in results.peers]
    rate_b = results.peers[0].rate
    run = median_by(runs, lambda r: r.steady.per_s)
    setup["done_line"] = run.done_line
    setup["rounds"] = {
        "a": [r.per_s for r in rates_a],
        "d_steady": [r.steady.per_s for r in runs],
        "d_wall": [r.wall.per_s for r in runs],
    }
    results.rates += [median_by(rates_a, lambda r: r.per_s), rate_b, rate_c, run.steady, run.wall]
    results.shares = {
        "a_tokenize": float(np.median(tokenize_shares)),
        **time_spent(run.done_line, run.steady.seconds),
    }
    lengths = embedder.tokenize(texts).lengths
    results.padding += [*policy_padding(embedder, lengths, args.batch_size), naive_padding]
    results.quality = quality(workdir / f"pipeline-{runs.index(run)}", ids, reference)


def run_rounds(
    args: argparse.Namespace,
    setup: dict[str, Any],
    groups: list[str],
    workdir: Path,
    retimed: list[tuple[Peer, Timer]],
) -> tuple[list[Rate], list[float], list[PipelineRun], dict[str, list[Rate]]]:
    """Each round: (a) in a fresh process, the contenders for "best" again, then (d);
    (a)'s rates and tokenizing shares, (d)'s runs, and each contender's rates."""
    peer_rounds: dict[str, list[Rate]] = {peer.rate.key: [] for peer, _ in retimed}
    rates_a: list[Rate] = []
    tokenize_shares: list[float] = []
    runs: list[PipelineRun] = []
    for n, group in enumerate(groups):
        round_note = f" (round {n + 1} of {args.repeat})" if args.repeat > 1 else ""
        say(f"(a) raw model, in a fresh process{round_note}")
        rate_a, tokenize_share = bench_raw_in_fresh_process(
            args, setup["precision"], setup["device"]
        )
        rates_a.append(rate_a)
        tokenize_shares.append(tokenize_share)
        for peer, timer in retimed:
            say(f"peer {peer.rate.name} again{round_note}")
            peer_rounds[peer.rate.key].append(call_on_fresh_thread(timer))
        say(f"(d) pipeline run --until-end{round_note}")
        output = workdir / f"pipeline-{n}"
        runs.append(bench_pipeline(args, setup, group, output, workdir / f"run-{n}.log"))
    return rates_a, tokenize_shares, runs, peer_rounds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_libraries()
    if args.raw_only:
        return raw_only(args)
    kafka = KafkaSettings(bootstrap_servers=args.bootstrap_servers)
    workdir = Path(tempfile.mkdtemp(prefix="pipeline-bench-"))
    try:
        results = run_all(args, workdir, kafka)
    except (HarnessError, PipelineError) as exc:
        say(f"failed: {exc}")
        return 1
    finally:
        if args.keep:
            say(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(render(results), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results.as_json(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
