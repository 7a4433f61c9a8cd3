#!/usr/bin/env python3
"""Chunking on long documents (issue 35): `pipeline run --chunk-tokens` against
sentence-transformers encoding the same chunk texts, side by side in one run; and the
worker's peak RSS with the biggest records against --max-batch-bytes.

The corpus: `--records` documents of `--min-chars` to `--max-chars` characters (lengths
log-uniform, default 2,000 to 60,000), each a run of pieces of this machine's texts (the
standard library's sources, /usr/share/doc), picked with `--seed`: the same machine and
seed give the same corpus. It is published once to a fresh topic, then:

  worker  `pipeline run --until-end --chunk-tokens N --chunk-overlap M` on a fresh group
          and output; its rate is timed after model load (its last line `done: R records
          (... as C chunks ...) in B batches, S s`): chunks/s = the Parquet rows / S,
          tokens/s = the sum of the rows' `tokens` column (special tokens included) / S;
          its peak RSS is polled from /proc (the worker's VmHWM; and the sum of its and
          its children's VmRSS: the tokenizer process);
  st      sentence-transformers `encode(texts)` with its default batch size (32), fp32,
          on the same CPU, of the SAME chunk texts read back from the Parquet rows, timed
          after a warm-up; its vectors also give the worker's quality (cosine, min/mean);
  big     a second, short worker pass over only the `--big-records` largest records, with
          `--big-max-batch-bytes` (small): its peak RSS, beside the first pass's with the
          default --max-batch-bytes, shows what bounds the worker's memory.

It prints a markdown table and one JSON line (`--json PATH`: also written there).

    .venv/bin/python scripts/chunk_bench.py                  # 2,000 records: long on CPU
    .venv/bin/python scripts/chunk_bench.py --records 300    # a quicker run
    .venv/bin/python scripts/chunk_bench.py --records 40 --max-chars 20000 --big-records 5

Exits 0 once everything was measured; 1 when a step failed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import re
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DONE = re.compile(
    r"done: (?P<records>\d+) records \((?P<embedded>\d+) embedded(?: as (?P<chunks>\d+) "
    r"chunks)?, (?P<dead>\d+) dead-lettered\) in (?P<batches>\d+) batches, "
    r"(?P<seconds>[\d.]+)s"
)
FIRST_RECORD = "first record polled"
DOC_SUFFIXES = ("", ".txt", ".md", ".rst", ".gz")
MAX_SOURCE_CHARS = 400_000  # of one file, at most: the pool stays small
ST_BATCH = 32  # sentence-transformers' encode() default
WARMUP_TEXTS = 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=2000, help="documents in the corpus")
    parser.add_argument("--min-chars", type=int, default=2000)
    parser.add_argument("--max-chars", type=int, default=60_000)
    parser.add_argument("--seed", type=int, default=35, help="picks the corpus")
    parser.add_argument("--chunk-tokens", type=int, default=200)
    parser.add_argument("--chunk-overlap", type=int, default=32)
    parser.add_argument(
        "--max-chunks", type=int, default=256, help="the worker's --max-chunks (none dropped)"
    )
    parser.add_argument(
        "--precision",
        default="auto",
        help="the worker's --precision (sentence-transformers runs fp32 whatever it is)",
    )
    parser.add_argument("--partitions", type=int, default=3, help="of the fresh topic")
    parser.add_argument(
        "--big-records", type=int, default=20, help="the largest records, for the RSS pass"
    )
    parser.add_argument(
        "--big-max-batch-bytes",
        type=int,
        default=131_072,
        help="the RSS pass's --max-batch-bytes (a larger record travels alone)",
    )
    parser.add_argument(
        "--big-default-too",
        action="store_true",
        help="also run the largest records with the default --max-batch-bytes, to compare",
    )
    parser.add_argument(
        "--worker-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="more flags for both worker passes (repeatable: --worker-flag=--replicas=1)",
    )
    parser.add_argument(
        "--bootstrap-servers",
        default=os.environ.get("PIPELINE_BOOTSTRAP_SERVERS", "127.0.0.1:9092"),
    )
    parser.add_argument("--timeout", type=float, default=7200, help="seconds, per worker pass")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--keep", action="store_true", help="keep the temp dir (printed), topics and groups"
    )
    return parser.parse_args(argv)


def say(message: str) -> None:
    print(f"[chunk-bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- corpus


def _readable(path: Path) -> str | None:
    try:
        raw = path.read_bytes() if path.suffix != ".gz" else gzip.decompress(path.read_bytes())
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None
    printable = sum(c.isprintable() or c in "\n\t" for c in text[:4000])
    return text if printable >= 0.98 * min(len(text), 4000) else None


def source_pool(min_chars: int = 2000) -> list[str]:
    """This machine's texts, in a fixed order: the standard library's sources (its test
    suite left out) and /usr/share/doc's plain and gzipped texts."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p
        for p in stdlib.rglob("*.py")
        if "test" not in p.relative_to(stdlib).parts and "site-packages" not in p.parts
    )
    docs = Path("/usr/share/doc")
    if docs.is_dir():
        paths += sorted(
            p
            for p in docs.rglob("*")
            if p.is_file() and not p.is_symlink() and p.suffix in DOC_SUFFIXES
        )
    pool = []
    for path in paths:
        text = _readable(path)
        if text is not None and len(text.strip()) >= min_chars:
            pool.append(text[:MAX_SOURCE_CHARS])
    return pool


def corpus(records: int, seed: int, min_chars: int, max_chars: int) -> list[str]:
    """`records` documents, lengths log-uniform in [min_chars, max_chars], each pieces of
    the pool's texts joined by blank lines."""
    pool = source_pool()
    if not pool:
        raise SystemExit("no texts found on this machine to build the corpus from")
    rng = random.Random(seed)
    texts = []
    for _ in range(records):
        length = round(math.exp(rng.uniform(math.log(min_chars), math.log(max_chars))))
        parts: list[str] = []
        total = 0
        while total < length:
            source = rng.choice(pool)
            start = rng.randrange(max(1, len(source) - 1000))
            start = source.find("\n", start) + 1  # from a line start
            piece = source[start : start + length - total].strip()
            if piece:
                parts.append(piece)
                total += len(piece) + 2
        texts.append("\n\n".join(parts)[:length])
    return texts


# --------------------------------------------------------------------------- worker


@dataclass
class Pass:
    """One worker pass, measured from outside."""

    name: str
    records: int
    embedded: int
    chunks: int
    dead: int
    batches: int
    seconds: float  # first record polled to last commit (after model load)
    wall_s: float  # process start to exit
    peak_rss_mb: float  # the worker process's VmHWM
    peak_tree_rss_mb: float  # the most its and its children's VmRSS summed reached
    rss_at_first_record_mb: float | None  # model loaded, nothing embedded yet
    rows: int = 0
    tokens: int = 0
    precision: str = ""
    max_batch_bytes: int | None = None
    largest_chars: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _status_kb(pid: int, key: str) -> int:
    try:
        for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class RssPoller:
    """Polls a process's VmHWM and its tree's summed VmRSS until stopped; and its VmRSS
    when its log first says it polled a record (model loaded, nothing embedded yet)."""

    def __init__(self, pid: int, log: Path, period: float = 0.05) -> None:
        self.pid, self.log, self.period = pid, log, period
        self.hwm_kb = self.tree_kb = 0
        self.at_first_record_kb: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from harness.worker import tree_pids  # after main() put the project on the path

        while not self._stop.is_set():
            self.hwm_kb = max(self.hwm_kb, _status_kb(self.pid, "VmHWM"))
            self.tree_kb = max(
                self.tree_kb, sum(_status_kb(p, "VmRSS") for p in tree_pids(self.pid))
            )
            if self.at_first_record_kb is None and FIRST_RECORD in self.log.read_text():
                self.at_first_record_kb = _status_kb(self.pid, "VmRSS")
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_worker(
    name: str, args: argparse.Namespace, topic: str, group: str, output: Path, *flags: str
) -> Pass:
    argv = [
        sys.executable, "-m", "pipeline.cli", "--bootstrap-servers", args.bootstrap_servers,
        "run", "--topic", topic, "--group", group, "--output", str(output), "--no-progress",
        "--until-end", "--precision", args.precision,
        "--chunk-tokens", str(args.chunk_tokens), "--chunk-overlap", str(args.chunk_overlap),
        "--max-chunks", str(args.max_chunks), "--max-text-bytes", str(4 * args.max_chars + 1024),
        *args.worker_flag, *flags,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log = output.parent / f"{output.name}.log"
    say(f"{name}: {' '.join(argv[2:])}")
    began = time.monotonic()
    with open(log, "w") as sink:
        worker = subprocess.Popen(argv, stdout=sink, stderr=sink, env=env, cwd=REPO)
        poller = RssPoller(worker.pid, log)
        try:
            code = worker.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            worker.kill()
            code = worker.wait()
        finally:
            poller.stop()
    wall = time.monotonic() - began
    text = log.read_text()
    if code != 0:
        raise SystemExit(f"{name}: the worker failed (exit {code}); its log {log} ends:\n"
                         + "\n".join(text.splitlines()[-20:]))  # fmt: skip
    done = [m for m in DONE.finditer(text)]
    if not done:
        raise SystemExit(f"{name}: no parsable `done:` line in {log}")
    m = done[-1]
    # Not wait4's ru_maxrss: a child's counts the RSS of its parent (this process) at
    # the fork, which exec leaves in the child's maximum.
    hwm_kb = poller.hwm_kb
    return Pass(
        name, int(m["records"]), int(m["embedded"]), int(m["chunks"] or m["embedded"]),
        int(m["dead"]), int(m["batches"]), float(m["seconds"]), wall, hwm_kb / 1024,
        max(poller.tree_kb, hwm_kb) / 1024,
        poller.at_first_record_kb / 1024 if poller.at_first_record_kb else None,
    )  # fmt: skip


def read_rows(output: Path) -> tuple[list[str], list[int], Any, str]:
    """The chunk rows of an output in file order: texts, tokens, vectors, precision."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = sorted((output / "vectors").glob("*.parquet"))
    table = pa.concat_tables(
        pq.read_table(p, columns=["text", "tokens", "embedding"]) for p in paths
    )
    meta = pq.read_schema(paths[0]).metadata or {}
    vectors = np.asarray(table["embedding"].to_pylist(), dtype=np.float32)
    precision = meta.get(b"embedding.precision", b"?").decode()
    return table["text"].to_pylist(), table["tokens"].to_pylist(), vectors, precision


# --------------------------------------------------------------------------- sentence-transformers


def sentence_transformers_pass(texts: list[str]) -> tuple[float, Any, int]:
    """Seconds for encode(texts) at the default batch size, fp32 on the CPU, after a
    warm-up; the vectors; torch's threads."""
    import torch
    from sentence_transformers import SentenceTransformer

    from pipeline.core.host import call_on_fresh_thread
    from pipeline.model.spec import resolve_model_path

    _, model_dir = resolve_model_path("default")

    def run() -> tuple[float, Any]:
        model = SentenceTransformer(str(model_dir), device="cpu")
        model.encode(texts[:WARMUP_TEXTS], batch_size=ST_BATCH, show_progress_bar=False)
        started = time.perf_counter()
        vectors = model.encode(texts, batch_size=ST_BATCH, show_progress_bar=False)
        return time.perf_counter() - started, vectors

    seconds, vectors = call_on_fresh_thread(run)  # its own OpenMP team, as bench.py's
    return seconds, vectors, torch.get_num_threads()


# --------------------------------------------------------------------------- the run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    import numpy as np
    from harness import broker

    from pipeline.core.config import KafkaSettings
    from pipeline.model.spec import resolve_model_path

    kafka = KafkaSettings(bootstrap_servers=args.bootstrap_servers)
    workdir = Path(tempfile.mkdtemp(prefix="chunk-bench-"))
    say(f"building {args.records} documents of {args.min_chars}-{args.max_chars} characters")
    texts = corpus(args.records, args.seed, args.min_chars, args.max_chars)
    chars = [len(t) for t in texts]
    topic = broker.new_topic(kafka, args.partitions, prefix="chunk-bench")
    run_id = uuid.uuid4().hex[:8]
    groups = [f"chunk-bench-{run_id}", f"chunk-bench-{run_id}-big"]
    topics = [topic, f"{topic}.dlq"]
    big_default: Pass | None = None
    try:
        say(f"publishing {len(texts)} records ({sum(chars) / 1e6:.1f}M characters) to {topic}")
        records = ({"id": f"doc-{i}", "text": t} for i, t in enumerate(texts))
        broker.publish(kafka, topic, records, args.partitions)

        main_pass = run_worker("worker", args, topic, groups[0], workdir / "out")
        row_texts, tokens, worker_vectors, precision = read_rows(workdir / "out")
        main_pass.rows, main_pass.tokens, main_pass.precision = (
            len(row_texts),
            sum(tokens),
            precision,
        )
        main_pass.largest_chars = max(chars)
        if main_pass.dead:
            say(f"worker: {main_pass.dead} records dead-lettered (see the log)")

        say(f"sentence-transformers: encode() of the same {len(row_texts)} chunk texts")
        st_seconds, st_vectors, threads = sentence_transformers_pass(row_texts)
        st_vectors = np.asarray(st_vectors, dtype=np.float32)
        cosine = (st_vectors * worker_vectors).sum(axis=1) / (
            np.linalg.norm(st_vectors, axis=1) * np.linalg.norm(worker_vectors, axis=1)
        )

        biggest = sorted(range(len(texts)), key=lambda i: -chars[i])[: args.big_records]
        big_topic = broker.new_topic(kafka, 1, prefix="chunk-bench-big")
        topics += [big_topic, f"{big_topic}.dlq"]
        big_records = ({"id": f"doc-{i}", "text": texts[i]} for i in biggest)
        broker.publish(kafka, big_topic, big_records, 1)
        big_pass = run_worker(
            "big", args, big_topic, groups[1], workdir / "big",
            "--max-batch-bytes", str(args.big_max_batch_bytes),
        )  # fmt: skip
        big_pass.max_batch_bytes = args.big_max_batch_bytes
        big_pass.largest_chars = max(chars[i] for i in biggest)
        big_rows = read_rows(workdir / "big")
        big_pass.rows, big_pass.tokens = len(big_rows[0]), sum(big_rows[1])
        if args.big_default_too:
            groups.append(f"chunk-bench-{run_id}-big-default")
            big_default = run_worker("big-default", args, big_topic, groups[-1], workdir / "bigd")
            big_default.largest_chars = big_pass.largest_chars
            big_default.rows = big_pass.rows
    finally:
        if not args.keep:
            broker.delete(kafka, topics, groups)
    if args.keep:
        say(f"kept {workdir}, topics {topics}, groups {groups}")
    else:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)

    model_name, _ = resolve_model_path("default")
    seconds = main_pass.seconds
    results = {
        "bench": "chunk",
        "model": model_name,
        "corpus": {
            "records": len(texts),
            "seed": args.seed,
            "chars_total": sum(chars),
            "chars_min": min(chars),
            "chars_median": sorted(chars)[len(chars) // 2],
            "chars_max": max(chars),
        },
        "chunk_tokens": args.chunk_tokens,
        "chunk_overlap": args.chunk_overlap,
        "cpus": len(os.sched_getaffinity(0)),
        "worker": {
            **asdict(main_pass),
            "chunks_per_s": main_pass.rows / seconds,
            "tokens_per_s": main_pass.tokens / seconds,
        },
        "sentence_transformers": {
            "batch_size": ST_BATCH,
            "precision": "fp32",
            "torch_threads": threads,
            "seconds": st_seconds,
            "chunks_per_s": len(row_texts) / st_seconds,
            "tokens_per_s": main_pass.tokens / st_seconds,
        },
        "ratio_worker_st": st_seconds / seconds,
        "quality": {"cosine_min": float(cosine.min()), "cosine_mean": float(cosine.mean())},
        "big": asdict(big_pass),
        "big_default": asdict(big_default) if big_default else None,
    }
    print(table(results))
    line = json.dumps(results, sort_keys=True)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")
    return 0


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def table(r: dict[str, Any]) -> str:
    w, st, big, c = r["worker"], r["sentence_transformers"], r["big"], r["corpus"]
    lines = [
        f"Corpus: {c['records']} records, {c['chars_total'] / 1e6:.1f}M characters "
        f"({c['chars_min']}-{c['chars_max']}, median {c['chars_median']}); "
        f"--chunk-tokens {r['chunk_tokens']} --chunk-overlap {r['chunk_overlap']}; "
        f"{r['cpus']} CPUs; model {r['model']}",
        "",
        "| | chunks | tokens | seconds | chunks/s | tokens/s |",
        "|---|---:|---:|---:|---:|---:|",
        f"| worker (`pipeline run`, {w['precision']}, after model load) | {w['rows']} | "
        f"{w['tokens']} | {w['seconds']:.1f} | {w['chunks_per_s']:.1f} | "
        f"{w['tokens_per_s']:.0f} |",
        f"| sentence-transformers encode(batch_size={st['batch_size']}), fp32, "
        f"{st['torch_threads']} threads | {w['rows']} | {w['tokens']} | {st['seconds']:.1f} | "
        f"{st['chunks_per_s']:.1f} | {st['tokens_per_s']:.0f} |",
        f"| worker / sentence-transformers | | | | {r['ratio_worker_st']:.2f}x | "
        f"{r['ratio_worker_st']:.2f}x |",
        "",
        f"Worker vectors against sentence-transformers': cosine min "
        f"{r['quality']['cosine_min']:.6f}, mean {r['quality']['cosine_mean']:.6f}.",
        "",
        "| worker pass | records | largest record (chars) | --max-batch-bytes | chunks | "
        "RSS at first record (MiB) | peak RSS (MiB) | with children (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| whole corpus | {w['records']} | {w['largest_chars']} | default | {w['rows']} | "
        f"{_mb(w['rss_at_first_record_mb'])} | {w['peak_rss_mb']:.0f} | "
        f"{w['peak_tree_rss_mb']:.0f} |",
        f"| {big['records']} largest records | {big['records']} | {big['largest_chars']} | "
        f"{big['max_batch_bytes']} | {big['rows']} | {_mb(big['rss_at_first_record_mb'])} | "
        f"{big['peak_rss_mb']:.0f} | {big['peak_tree_rss_mb']:.0f} |",
    ]
    if r["big_default"]:
        d = r["big_default"]
        lines.append(
            f"| {d['records']} largest records | {d['records']} | {d['largest_chars']} | "
            f"default | {d['rows']} | {_mb(d['rss_at_first_record_mb'])} | "
            f"{d['peak_rss_mb']:.0f} | {d['peak_tree_rss_mb']:.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
