"""Upsert mode at scale (issue 34): the current view and the index against the number
of live documents, side by side in one run.

For each size N (default 10k, 100k, 1M live documents), a child process builds an
upsert-mode output with the real sink (sinks.parquet: N documents, 384-d vectors,
~120-character texts), applies it to the view (sinks.view) and the index, and exits.
A second child then plays a worker under a steady stream of `--rate` records a
second for `--seconds` (90 % new documents, 5 % updates, 5 % deletes of uniformly
random live keys): a writer thread publishes a segment every second, and the view
applies what is published every `--interval` seconds, as the worker's view stage
does. It reports:

  apply    - seconds per view apply, and the changes a second it sustains (records
             applied / seconds spent applying);
  delay    - how long after its publish a segment's records are in the view (p50, max);
  index    - seconds per index sync of the same segments;
  rss      - the child's peak RSS, which must not grow with N.

Beside it, the copy-on-write alternative: one merge of `--rate` changes into a Delta
Lake table of the same N rows (deltalake's merge), the format the view did not take.

    .venv/bin/python scripts/view_bench.py
    .venv/bin/python scripts/view_bench.py --sizes 10000,100000 --seconds 20
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.core.documents import Deletion, DocumentKeys  # noqa: E402
from pipeline.core.layout import SegmentKey  # noqa: E402
from pipeline.core.model_info import ModelInfo  # noqa: E402
from pipeline.core.records import GoodRecord, SourceRecord  # noqa: E402
from sinks.index.store import IndexStore  # noqa: E402
from sinks.parquet import ParquetSink  # noqa: E402
from sinks.view import ViewStore  # noqa: E402

DIM = 384
TOPIC = "docs"
BUILD_SEGMENT = 20_000


class Writer:
    """Publishes segments of one partition through the real sink."""

    def __init__(self, output: Path, seed: int = 5) -> None:
        info = ModelInfo(
            "bench", "/m", "sha256:bench", DIM, "mean", True, 256, "fp32", "cpu",
            similarity="cosine",
        )  # fmt: skip
        self.sink = ParquetSink(output, info, DocumentKeys())
        self.sink.prepare()
        self.rng = np.random.default_rng(seed)
        self.next_offset = 0

    def publish(self, keys: list[str], deleted: list[bool]) -> None:
        first = self.next_offset
        sources = [
            SourceRecord(TOPIC, 0, first + i, 1, k.encode(), b"") for i, k in enumerate(keys)
        ]
        good = [
            GoodRecord(s, f"document {k} version {s.offset} " + "lorem ipsum " * 8, k, None)
            for s, k, d in zip(sources, keys, deleted, strict=True)
            if not d
        ]
        gone = [Deletion(s, k) for s, k, d in zip(sources, keys, deleted, strict=True) if d]
        vectors = self.rng.standard_normal((len(good), DIM)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        last = first + len(keys) - 1
        staged = self.sink.stage(
            SegmentKey(TOPIC, 0, first), last, good, vectors, len(keys), deletions=gone
        )
        assert self.sink.publish(staged)
        self.next_offset = last + 1


def build(output: Path, size: int) -> dict:
    writer = Writer(output)
    for start in range(0, size, BUILD_SEGMENT):
        keys = [f"doc-{i}" for i in range(start, min(size, start + BUILD_SEGMENT))]
        writer.publish(keys, [False] * len(keys))
    started = time.perf_counter()
    ViewStore(output).sync()
    view_s = time.perf_counter() - started
    started = time.perf_counter()
    IndexStore(output).sync()
    return {"build_view_s": view_s, "build_index_s": time.perf_counter() - started}


def steady(output: Path, size: int, rate: int, seconds: float, interval: float) -> dict:
    """A writer publishing `rate` records a second while the view follows."""
    writer = Writer(output, seed=9)
    writer.next_offset = size
    view, index = ViewStore(output), IndexStore(output)
    rng = np.random.default_rng(3)
    live, next_key = list(range(size)), size
    published: dict[int, float] = {}  # a segment's last offset -> when published
    stop = threading.Event()
    applies: list[tuple[float, int]] = []
    delays: list[float] = []

    def follow() -> None:
        while not stop.is_set() or view.positions().get(f"{TOPIC}:0", -1) < writer.next_offset - 1:
            time.sleep(interval)
            started = time.perf_counter()
            rows = view.sync()
            if rows:
                applies.append((time.perf_counter() - started, rows))
                through = view.positions()[f"{TOPIC}:0"]
                now = time.monotonic()
                for last in [o for o in published if o <= through]:
                    delays.append(now - published.pop(last))

    follower = threading.Thread(target=follow)
    follower.start()
    index_s: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        tick = time.monotonic()
        keys, deleted = [], []
        for _ in range(rate):
            roll = rng.random()
            if roll < 0.9 or not live:
                keys.append(f"doc-{next_key}")
                live.append(next_key)
                next_key += 1
                deleted.append(False)
            else:
                at = int(rng.integers(len(live)))
                keys.append(f"doc-{live[at]}")
                deleted.append(roll >= 0.95)
                if roll >= 0.95:
                    live[at] = live[-1]
                    live.pop()
        writer.publish(keys, deleted)
        published[writer.next_offset - 1] = time.monotonic()
        started = time.perf_counter()
        index.sync()
        index_s.append(time.perf_counter() - started)
        time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    stop.set()
    follower.join()
    apply_s = [s for s, _ in applies]
    return {
        "records": rate * len(index_s),
        "live_after": len(live),
        "applies": len(applies),
        "apply_s_p50": statistics.median(apply_s),
        "apply_s_max": max(apply_s),
        "changes_per_s": sum(r for _, r in applies) / sum(apply_s),
        "delay_s_p50": statistics.median(delays),
        "delay_s_max": max(delays),
        "index_s_p50": statistics.median(index_s),
        "index_s_max": max(index_s),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def delta_merge(size: int, changes: int, timeout_s: float) -> float | None:
    """Seconds for one merge of `changes` rows into a Delta table of `size` rows."""
    code = f"""
import sys, time, numpy as np, pyarrow as pa
from deltalake import DeltaTable, write_deltalake
size, changes, path = {size}, {changes}, sys.argv[1]
rng = np.random.default_rng(0)
def table(keys, first):
    v = rng.standard_normal((len(keys), {DIM}), dtype=np.float32)
    text = pa.array(["lorem ipsum " * 10] * len(keys))
    return pa.table({{"doc_key": pa.array(keys), "text": text,
        "offset": pa.array(np.arange(first, first + len(keys)), pa.int64()),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(v.ravel()), {DIM})}})
for start in range(0, size, 200_000):
    keys = [f"doc-{{i}}" for i in range(start, min(size, start + 200_000))]
    write_deltalake(path, table(keys, start), mode="append")
keys = [f"doc-{{i}}" for i in rng.choice(size * 10 // 9, changes, replace=False)]
started = time.perf_counter()
(DeltaTable(path).merge(table(keys, size), "t.doc_key = s.doc_key", source_alias="s",
    target_alias="t").when_matched_update_all().when_not_matched_insert_all().execute())
print(time.perf_counter() - started)
"""
    with tempfile.TemporaryDirectory(prefix="view-bench-delta-") as folder:
        try:
            done = subprocess.run(
                [sys.executable, "-c", code, folder], capture_output=True, text=True,
                timeout=timeout_s, check=True,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return None
        return float(done.stdout.strip().splitlines()[-1])


def child(args: argparse.Namespace) -> None:
    output = Path(args.output)
    if args.phase == "build":
        result = build(output, args.size)
    else:
        result = steady(output, args.size, args.rate, args.seconds, args.interval)
    print(json.dumps(result))


def run_child(phase: str, output: Path, size: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", phase, "--output", str(output),
               "--size", str(size), "--rate", str(args.rate), "--seconds", str(args.seconds),
               "--interval", str(args.interval)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"view_bench: the {phase} child at {size:,} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--rate", type=int, default=1000, help="records a second")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=5.0, help="view apply interval")
    parser.add_argument("--delta-timeout-s", type=float, default=600.0)
    parser.add_argument("--child", dest="phase", choices=["build", "steady"])
    parser.add_argument("--output")
    parser.add_argument("--size", type=int)
    args = parser.parse_args()
    if args.phase:
        child(args)
        return
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        folder = Path(tempfile.mkdtemp(prefix=f"view-bench-{size}-"))
        try:
            built = run_child("build", folder, size, args)
            row = {"live": size, **built, **run_child("steady", folder, size, args)}
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        row["delta_merge_s"] = delta_merge(
            size, args.rate * int(args.interval), args.delta_timeout_s
        )
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print_table(rows, args)


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    merged = args.rate * int(args.interval)
    print(f"\nsteady {args.rate} records/s for {args.seconds:.0f} s, view applied every "
          f"{args.interval:g} s; Delta: one merge of {merged} rows\n")  # fmt: skip
    print("| live docs | view apply p50 / max (s) | changes/s applied | view delay p50 / max (s)"
          " | index sync p50 / max (s) | peak RSS (MB) | Delta merge (s) |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = rows[0]
    for r in rows:
        delta = "timeout" if r["delta_merge_s"] is None else f"{r['delta_merge_s']:.2f}"
        print(
            f"| {r['live']:,} | {r['apply_s_p50']:.2f} / {r['apply_s_max']:.2f} "
            f"| {r['changes_per_s']:,.0f} | {r['delay_s_p50']:.1f} / {r['delay_s_max']:.1f} "
            f"| {r['index_s_p50']:.3f} / {r['index_s_max']:.3f} | {r['peak_rss_mb']:.0f} "
            f"| {delta} |"
        )
    last = rows[-1]
    print(
        f"\nfrom {base['live']:,} to {last['live']:,} live documents: view apply "
        f"x{last['apply_s_p50'] / base['apply_s_p50']:.2f}, RSS "
        f"x{last['peak_rss_mb'] / base['peak_rss_mb']:.2f}"
    )


if __name__ == "__main__":
    main()
