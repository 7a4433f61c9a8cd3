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

It then prints the ratios d/a, d/b, d/c beside their targets, the padding efficiency of
(d)'s batching policy and of (c)'s arrival-order batches, and the quality of the vectors
(d) stored, against fp32: mean and minimum cosine, neighbour recall@10, PASS/FAIL on the
precision gate. (b) and (c) run with one torch thread count (--threads); (a) with the
worker's own layout of model replicas x threads (pipeline.core.host.plan_cpu), as (d) does.

    .venv/bin/python scripts/bench.py [--records 3000] [--precision auto] [--device auto]
        [--batch-size 4096] [--partitions 3] [--repeat 1] [--json results.json] [--keep]

Each of (a) to (c) loads its model and runs on one fresh thread, as `pipeline run`
loads its model on a thread that exits and embeds on its embed-stage thread: one
OpenMP team at a time, so none pays throttled spin-waits (see pipeline.core.host).
(a) runs right before (d), so that the two rates the headline ratio divides are
measured a minute apart at most, on a machine whose speed drifts; and in a process
of its own, since the bench process has by then warmed its heap on (b) and (c),
which made (a) 5-10% faster than any fresh process could be.
(d)'s output goes to `run-N.log` in the temp dir (kept with --keep). With --repeat N,
(a) and (d) run N rounds, alternating, and the ratios use their medians.
A 3000-record run on CPU takes several minutes. Exits 0 once everything was measured,
whether or not the targets were met; 1 when a variant failed (or (d) passed --timeout).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from pipeline.core.config import DEFAULT_BOOTSTRAP, DEVICES, PRECISIONS, KafkaSettings, WorkerConfig
from pipeline.core.errors import PipelineError
from pipeline.core.host import call_on_fresh_thread
from pipeline.model.embedder import Embedder, pick_device
from pipeline.model.precision import (
    DEFAULT_MIN_COSINE,
    DEFAULT_MIN_RECALL,
    cosine_rows,
    neighbour_recall,
    resolve_precision,
)
from pipeline.model.spec import ModelSpec, resolve_model_path

T = TypeVar("T")
NAIVE_BATCH = 32
ST_BATCH = 32
WARMUP_TEXTS = 32
NAIVE_IDLE_TIMEOUT_S = 120.0
RATIO_TARGETS = {"d/a": 0.90, "d/b": 2.0, "d/c": 4.0}
PADDING_TARGET = 0.90
_DONE_RE = re.compile(
    r"done: (?P<records>\d+) records .*? in (?P<batches>\d+) batches, "
    r"(?P<seconds>[\d.]+) ?s, (?P<rate>[\d,.]+) records/s"
)


@dataclass(frozen=True)
class Rate:
    """One variant's throughput; key is a, b, c, d_steady or d_wall."""

    key: str
    name: str
    texts: int
    seconds: float
    per_s: float

    @classmethod
    def timed(cls, key: str, name: str, texts: int, seconds: float) -> Rate:
        return cls(key, name, texts, seconds, texts / seconds if seconds > 0 else 0.0)


@dataclass(frozen=True)
class Padding:
    label: str
    real_tokens: int
    computed_tokens: int
    target: float | None = None

    @property
    def efficiency(self) -> float:
        return self.real_tokens / self.computed_tokens if self.computed_tokens else 1.0


@dataclass(frozen=True)
class Quality:
    rows: int
    expected: int
    distinct_ids: int
    cosine_mean: float
    cosine_min: float
    recall_at_10: float

    @property
    def passed(self) -> bool:
        return (
            self.rows == self.expected == self.distinct_ids
            and self.cosine_mean >= DEFAULT_MIN_COSINE
            and self.recall_at_10 >= DEFAULT_MIN_RECALL
        )


@dataclass
class Results:
    setup: dict[str, Any]
    rates: list[Rate] = field(default_factory=list)
    padding: list[Padding] = field(default_factory=list)
    quality: Quality | None = None

    def rate(self, key: str) -> float:
        return next(r.per_s for r in self.rates if r.key == key)

    def ratios(self) -> dict[str, dict[str, float]]:
        steady, wall = self.rate("d_steady"), self.rate("d_wall")
        out = {}
        for name in RATIO_TARGETS:
            base = self.rate(name[-1])
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
        }


class BenchError(RuntimeError):
    pass


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
    parser.add_argument("--raw-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds (d) may take before it is killed"
    )
    args = parser.parse_args(argv)
    for name in ("records", "batch_size", "partitions", "threads", "repeat"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


def make_texts(n: int) -> list[str]:
    """n real paragraphs; past what the corpus holds, repeats with a suffix."""
    from pipeline.core.corpus import sample_texts

    base = sample_texts(n)
    texts = list(base[:n])
    rounds = 1
    while len(texts) < n:
        texts += [f"{t} ({rounds})" for t in base[: n - len(texts)]]
        rounds += 1
    return texts


def make_ids(n: int) -> list[str]:
    return [f"bench-{i:06d}" for i in range(n)]


def quiet_libraries() -> None:
    """Progress bars and warnings of libraries would be mixed into the report."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # failures surface as errors


def load_note() -> str:
    """A warning when other work shares the CPUs: thread pools then stall on each other."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load < 0.5 * cores:
        return ""
    return f"load average {load:.1f} on {cores} cores: other work shares the CPUs"


def describe_hardware(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    from pipeline.model.precision import cpu_model

    return f"{cpu_model()}, {os.cpu_count()} cores"


def resolve(args: argparse.Namespace) -> tuple[str, str]:
    """(device, precision), both concrete."""
    from pipeline.core.corpus import sample_texts

    device = pick_device(args.device)
    precision = resolve_precision(args.model, device, args.precision, lambda: sample_texts(256))
    return device, precision


# -- Kafka ----------------------------------------------------------------------------


def create_topic(kafka: KafkaSettings, partitions: int) -> str:
    from pipeline.kafka import cluster

    topic = f"bench-{uuid.uuid4().hex[:10]}"
    with cluster.admin_client(kafka) as admin:
        cluster.create_topic(admin, kafka, topic, partitions)
    return topic


def publish(
    kafka: KafkaSettings, topic: str, ids: list[str], texts: list[str], partitions: int
) -> None:
    """Publishes {"id", "text"} JSON records round-robin over the partitions, acked by all."""
    from kafka import KafkaProducer

    producer = KafkaProducer(acks="all", linger_ms=20, **kafka.client_kwargs())
    try:
        futures = [
            producer.send(
                topic,
                value=json.dumps({"id": i, "text": t}, ensure_ascii=False).encode(),
                partition=n % partitions,
            )
            for n, (i, t) in enumerate(zip(ids, texts, strict=True))
        ]
        producer.flush(timeout=120)
        for future in futures:
            future.get(timeout=30)
    finally:
        producer.close(timeout=30)
    check_published(kafka, topic, len(ids))


def check_published(kafka: KafkaSettings, topic: str, expected: int) -> None:
    from pipeline.kafka import cluster

    with cluster.admin_client(kafka) as admin:
        partitions = cluster.partitions_of(admin, kafka, [topic])
    with cluster.offsets_consumer(kafka) as consumer:
        total = sum(cluster.end_offsets(consumer, kafka, partitions).values())
    if total != expected:
        raise BenchError(f"topic {topic} holds {total} records after publishing {expected}")


def delete_kafka_state(kafka: KafkaSettings, topics: list[str], groups: list[str]) -> None:
    """Best effort: the benchmark's topics and groups go, whatever failed before."""
    from pipeline.kafka import cluster

    try:
        with cluster.admin_client(kafka) as admin:
            existing = set(admin.list_topics())
            doomed = [t for t in topics if t in existing]
            if doomed:
                admin.delete_topics(doomed)
            admin.delete_groups(groups)
    except Exception as exc:  # cleaning up must not hide the results
        say(f"cleanup of topics {topics} / groups {groups} failed: {exc}")


# -- (a) raw model and (b) sentence-transformers ---------------------------------------


def bench_raw(embedder: Embedder, texts: list[str]) -> float:
    """Seconds to tokenize and embed texts, after a warm-up on a few of them."""
    embedder.embed_tokens(embedder.tokenize(texts[:WARMUP_TEXTS]))
    started = time.perf_counter()
    embedder.embed_tokens(embedder.tokenize(texts))
    return time.perf_counter() - started


def bench_raw_in_fresh_process(args: argparse.Namespace, precision: str, device: str) -> Rate:
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
    seconds = float(json.loads(proc.stdout.strip().splitlines()[-1])["seconds"])
    name = f"(a) raw model: Embedder {precision}, length-sorted passes"
    return Rate.timed("a", name, args.records, seconds)


def raw_only(args: argparse.Namespace) -> int:
    """The child side of bench_raw_in_fresh_process: prints {"seconds": S}."""
    import torch

    from pipeline.core.host import plan_cpu, usable_cpus

    # The raw model at the layout `pipeline run` gives it (replicas x threads).
    plan = plan_cpu(pick_device(args.device), usable_cpus())
    torch.set_num_threads(plan.threads_per_replica)
    texts = make_texts(args.records)

    def load_and_time() -> float:
        embedder = Embedder.load_planned(args.model, args.precision, plan)
        return bench_raw(embedder, texts)

    print(json.dumps({"seconds": call_on_fresh_thread(load_and_time)}), flush=True)
    return 0


def bench_sentence_transformers(
    model_dir: Path, device: str, texts: list[str]
) -> tuple[Rate, np.ndarray]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device=device)
    model.encode(texts[:WARMUP_TEXTS], batch_size=ST_BATCH, show_progress_bar=False)
    started = time.perf_counter()
    vectors = model.encode(texts, batch_size=ST_BATCH, show_progress_bar=False)
    seconds = time.perf_counter() - started
    name = f"(b) sentence-transformers encode(batch_size={ST_BATCH}), fp32"
    return Rate.timed("b", name, len(texts), seconds), np.asarray(vectors, dtype=np.float32)


# -- (c) the naive consumer ----------------------------------------------------------


class NaiveModel:
    """What a user writes from the model card: fp32, pad per batch, mean pool, L2."""

    def __init__(self, model_dir: Path, device: str) -> None:
        from transformers import AutoModel, AutoTokenizer

        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModel.from_pretrained(str(model_dir)).to(device).eval()
        self.max_length = ModelSpec.read(str(model_dir)).max_length
        self.real_tokens = 0
        self.computed_tokens = 0

    def embed(self, texts: list[str]) -> np.ndarray:
        import torch

        batch = self.tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        ).to(self.device)
        mask = batch["attention_mask"]
        self.real_tokens += int(mask.sum())
        self.computed_tokens += mask.numel()
        with torch.no_grad():
            hidden = self.model(**batch).last_hidden_state
            weights = mask.unsqueeze(-1).float()
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.cpu().numpy()


def write_naive_parquet(path: Path, ids: list[str], texts: list[str], vectors: np.ndarray) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    flat = pa.array(vectors.astype(np.float32, copy=False).ravel())
    table = pa.table(
        {
            "id": pa.array(ids, pa.string()),
            "text": pa.array(texts, pa.string()),
            "embedding": pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1]),
        }
    )
    pq.write_table(table, path)


def bench_naive(
    kafka: KafkaSettings,
    topic: str,
    group: str,
    naive: NaiveModel,
    expected: int,
    output: Path,
    warmup: list[str],
) -> tuple[Rate, Padding]:
    from kafka import KafkaConsumer

    naive.embed(warmup)
    naive.real_tokens = naive.computed_tokens = 0
    output.mkdir(parents=True)
    started = time.perf_counter()
    consumer = KafkaConsumer(
        topic,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_records=NAIVE_BATCH,
        **kafka.client_kwargs(),
    )
    try:
        consumed = _naive_loop(consumer, naive, expected, output)
    finally:
        consumer.close(autocommit=False)
    seconds = time.perf_counter() - started
    name = f"(c) naive consumer: polls of {NAIVE_BATCH}, arrival order, fp32, Parquet+commit"
    padding = Padding(
        f"(c) arrival order, polled batches of {NAIVE_BATCH} (measured)",
        naive.real_tokens,
        naive.computed_tokens,
    )
    return Rate.timed("c", name, consumed, seconds), padding


def _naive_loop(consumer: Any, naive: NaiveModel, expected: int, output: Path) -> int:
    consumed, batch_no, last_data = 0, 0, time.monotonic()
    while consumed < expected:
        polled = consumer.poll(timeout_ms=1000)
        records = [r for batch in polled.values() for r in batch]
        if not records:
            if time.monotonic() - last_data > NAIVE_IDLE_TIMEOUT_S:
                raise BenchError(f"(c) got nothing for {NAIVE_IDLE_TIMEOUT_S:.0f}s at {consumed}")
            continue
        last_data = time.monotonic()
        values = [json.loads(r.value) for r in records]
        texts = [v["text"] for v in values]
        vectors = naive.embed(texts)
        path = output / f"batch-{batch_no:06d}.parquet"
        write_naive_parquet(path, [v["id"] for v in values], texts, vectors)
        consumer.commit()
        consumed += len(records)
        batch_no += 1
    return consumed


# -- (d) pipeline run ----------------------------------------------------------------


@dataclass(frozen=True)
class PipelineRun:
    wall: Rate
    steady: Rate
    batches: int
    done_line: str


def median_by(items: list[T], rate: Callable[[T], float]) -> T:
    """The item with the median rate (the lower middle one of an even count)."""
    return sorted(items, key=rate)[(len(items) - 1) // 2]


def pipeline_command(
    args: argparse.Namespace, topic: str, group: str, output: Path, device: str, precision: str
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pipeline.cli",
        "--bootstrap-servers",
        args.bootstrap_servers,
        "run",
        "--topic",
        topic,
        "--group",
        group,
        "--output",
        str(output),
        "--until-end",
        "--batch-size",
        str(args.batch_size),
        "--precision",
        precision,
        "--device",
        device,
        "--model",
        args.model,
        "--no-progress",
    ]


def bench_pipeline(
    command: list[str], expected: int, timeout_s: float, log_path: Path
) -> PipelineRun:
    """Runs (d) with its stderr in log_path (kept with --keep); times start to exit."""
    # An explicit environment: a fork of this process must not hand its tokenizer
    # state (TOKENIZERS_PARALLELISM=false after a fork) to the worker.
    env = dict(os.environ)
    with log_path.open("w") as log_file:
        started = time.perf_counter()
        try:
            returncode = subprocess.run(
                command, stdout=log_file, stderr=subprocess.STDOUT, env=env, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            raise BenchError(
                f"(d) `pipeline run` still running after {timeout_s:.0f}s (killed):\n"
                + tail_of(log_path)
            ) from None
        wall = time.perf_counter() - started
    if returncode != 0:
        raise BenchError(f"(d) `pipeline run` exited {returncode}:\n{tail_of(log_path)}")
    line, records, batches, seconds, rate = parse_done_line(log_path.read_text())
    if records != expected:
        raise BenchError(f"(d) processed {records} records, expected {expected}: {line}")
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


def tail_of(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def parse_done_line(stderr: str) -> tuple[str, int, int, float, float]:
    """(line, records, batches, seconds, records/s) from the worker's last `done:` line."""
    lines = [ln for ln in stderr.splitlines() if "done: " in ln]
    match = _DONE_RE.search(lines[-1]) if lines else None
    if match is None:
        tail = "\n".join(stderr.splitlines()[-20:])
        raise BenchError(f"(d) printed no parsable `done:` line; stderr ends with:\n{tail}")
    records, seconds = int(match["records"]), float(match["seconds"])
    rate = float(match["rate"].replace(",", ""))
    # R is printed to whole records/s and S to 0.1 s: take the finer of R and N/S.
    if seconds > 0 and (rate <= 0 or 0.05 / seconds < 0.5 / rate):
        rate = records / seconds
    return lines[-1].strip(), records, int(match["batches"]), seconds, rate


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


def read_vectors(output: Path) -> tuple[list[str], np.ndarray]:
    """Ids and embeddings of every published Parquet file of a pipeline output dir."""
    import pyarrow.parquet as pq

    from pipeline.core.layout import iter_segments

    ids: list[str] = []
    blocks: list[np.ndarray] = []
    for segment in iter_segments(output):
        table = pq.read_table(segment.path, columns=["id", "embedding"])
        if table.num_rows == 0:
            continue
        column = table.column("embedding").combine_chunks()
        dim = column.type.list_size
        blocks.append(column.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim))
        ids += table.column("id").to_pylist()
    if not blocks:
        raise BenchError(f"(d) wrote no vectors under {output}")
    return ids, np.concatenate(blocks).astype(np.float32, copy=False)


def quality(output: Path, ids: list[str], reference: np.ndarray) -> Quality:
    """(d)'s stored vectors against fp32 ones, rows matched by id."""
    stored_ids, stored = read_vectors(output)
    position = {record_id: n for n, record_id in enumerate(ids)}
    unknown = [i for i in stored_ids if i not in position]
    if unknown:
        raise BenchError(f"(d) stored {len(unknown)} ids that were not published: {unknown[:3]}")
    rows = np.fromiter((position[i] for i in stored_ids), dtype=np.int64, count=len(stored_ids))
    # Compare each published record once (duplicates, if any, show in distinct_ids).
    first = np.unique(rows, return_index=True)[1]
    ref, cand = reference[rows[first]], stored[first]
    cosine = cosine_rows(ref, cand)
    return Quality(
        rows=len(stored_ids),
        expected=len(ids),
        distinct_ids=len(first),
        cosine_mean=float(cosine.mean()),
        cosine_min=float(cosine.min()),
        recall_at_10=neighbour_recall(ref, cand),
    )


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


def render_quality(q: Quality, precision: str) -> list[str]:
    return [
        f"quality of (d)'s stored vectors ({precision}) against fp32 (sentence-transformers):",
        f"  rows {q.rows} for {q.expected} records ({q.distinct_ids} distinct ids), "
        f"cosine mean {q.cosine_mean:.5f}, min {q.cosine_min:.5f}, "
        f"recall@10 {q.recall_at_10:.3f}",
        f"  {'PASS' if q.passed else 'FAIL'} (gate: every record once, cosine mean >= "
        f"{DEFAULT_MIN_COSINE}, recall@10 >= {DEFAULT_MIN_RECALL})",
    ]


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
    device, precision = call_on_fresh_thread(lambda: resolve(args))
    model_name, model_dir = resolve_model_path(args.model)
    texts, ids = make_texts(args.records), make_ids(args.records)
    embedder = call_on_fresh_thread(lambda: Embedder.load(args.model, precision, device))
    lengths = embedder.tokenize(texts).lengths
    setup = describe_setup(args, texts, lengths, device, precision, threads, model_name)
    setup["load_before"] = setup_note
    results = Results(setup)

    topic = create_topic(kafka, args.partitions)
    groups = [f"{topic}-naive", *(f"{topic}-pipeline-{n}" for n in range(args.repeat))]
    setup |= {"topic": topic, "groups": groups, "workdir": str(workdir)}
    try:
        say(f"publishing {len(texts)} records to {topic} ({args.partitions} partitions)")
        publish(kafka, topic, ids, texts, args.partitions)
        measure(args, results, embedder, texts, ids, model_dir, kafka, workdir)
    finally:
        if not args.keep:
            delete_kafka_state(kafka, [topic, f"{topic}.dlq"], groups)
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
    rate_b, reference = call_on_fresh_thread(
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
    rates_a: list[Rate] = []
    runs: list[PipelineRun] = []
    for n, group in enumerate(pipeline_groups):
        round_note = f" (round {n + 1} of {args.repeat})" if args.repeat > 1 else ""
        say(f"(a) raw model, in a fresh process{round_note}")
        rates_a.append(bench_raw_in_fresh_process(args, setup["precision"], setup["device"]))
        say(f"(d) pipeline run --until-end{round_note}")
        output = workdir / f"pipeline-{n}"
        command = pipeline_command(args, topic, group, output, setup["device"], setup["precision"])
        runs.append(bench_pipeline(command, len(texts), args.timeout, workdir / f"run-{n}.log"))
    run = median_by(runs, lambda r: r.steady.per_s)
    setup["done_line"] = run.done_line
    setup["rounds"] = {
        "a": [r.per_s for r in rates_a],
        "d_steady": [r.steady.per_s for r in runs],
        "d_wall": [r.wall.per_s for r in runs],
    }
    results.rates += [median_by(rates_a, lambda r: r.per_s), rate_b, rate_c, run.steady, run.wall]
    lengths = embedder.tokenize(texts).lengths
    results.padding += [*policy_padding(embedder, lengths, args.batch_size), naive_padding]
    results.quality = quality(workdir / f"pipeline-{runs.index(run)}", ids, reference)


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
    except (BenchError, PipelineError) as exc:
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
