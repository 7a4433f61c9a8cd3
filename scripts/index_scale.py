"""Index upkeep and search against the corpus size (issue 11), side by side in one run.

For each size N (default 10k, 100k, 1M synthetic 384-d vectors in Parquet
segments, indexed by `pipeline index rebuild`), a fresh child process plays a
worker: it publishes `--syncs` batches of `--batch` new vectors, syncing the
index after each, and reports per-sync seconds and bytes written and its own
peak RSS. Two variants run on the same data:

  shards   - this version: a sync writes the new vectors as a shard (and merges
             small shards in tiers), never reading the index;
  rewrite  - what workers did before: hold the whole index, add, write it all.

Then at the largest of `--search-sizes`: load time, single-query search p50 and
recall@10 of flat (exact), ivf and ivf-pq indexes built by rebuild, recall
measured here against the flat index's answers for the same queries.

The vectors are a mixture of 1,000 Gaussian clusters, L2-normalised (real
embeddings cluster; uniform noise would make every IVF look bad).

    .venv/bin/python scripts/index_scale.py
    .venv/bin/python scripts/index_scale.py --sizes 10000,100000 --search-sizes 100000
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.core.layout import SegmentKey, vectors_dir  # noqa: E402
from sinks.index.store import IndexStore  # noqa: E402
from sinks.parquet import schema  # noqa: E402
from sinks.segments import segment_metadata  # noqa: E402

TOPIC = "scale"
SEGMENT_ROWS = 10_000
CLUSTERS = 1_000


class Corpus:
    """Synthetic clustered vectors written as real segments of one partition."""

    def __init__(self, output: Path, dim: int, seed: int = 7) -> None:
        self.output, self.dim = output, dim
        self.rng = np.random.default_rng(seed)
        self.centers = np.random.default_rng(1).standard_normal((CLUSTERS, dim)).astype(np.float32)
        self.next_offset = 0
        vectors_dir(output).mkdir(parents=True, exist_ok=True)

    def vectors(self, n: int) -> np.ndarray:
        picks = self.rng.integers(0, CLUSTERS, n)
        v = self.centers[picks] + 0.6 * self.rng.standard_normal((n, self.dim)).astype(np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)

    def publish(self, n: int) -> None:
        first = self.next_offset
        offsets = np.arange(first, first + n, dtype=np.int64)
        flat = pa.array(self.vectors(n).ravel(), pa.float32())
        meta = segment_metadata(first, first + n - 1, n, "index-scale")
        meta["embedding.dim"] = str(self.dim)
        table = pa.Table.from_arrays(
            [
                pa.array([TOPIC] * n, pa.string()),
                pa.array(np.zeros(n, dtype=np.int32)),
                pa.array(offsets),
                pa.nulls(n, pa.binary()),
                pa.nulls(n, pa.string()),
                pa.array([""] * n, pa.string()),
                pa.array(np.zeros(n, dtype=np.int64)),
                pa.nulls(n, pa.string()),
                pa.FixedSizeListArray.from_arrays(flat, self.dim),
            ],
            schema=schema(self.dim).with_metadata(meta),
        )
        name = SegmentKey(TOPIC, 0, first).filename
        pq.write_table(table, vectors_dir(self.output) / name, compression="none")
        self.next_offset += n

    def fill(self, n: int) -> None:
        while self.next_offset < n:
            self.publish(min(SEGMENT_ROWS, n - self.next_offset))


def rss_mb() -> float:
    """Peak RSS of this process (VmHWM: unlike ru_maxrss, not inherited over fork+exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


# -- the child: one worker's syncs --------------------------------------------------


def child(output: Path, variant: str, syncs: int, batch: int, dim: int) -> dict:
    corpus = Corpus(output, dim, seed=99)
    corpus.next_offset = int(json.loads((output / "index" / "index.json").read_text())["count"])
    store = IndexStore(output)
    legacy = _legacy_index(store) if variant == "rewrite" else None
    rss_start = rss_mb()
    seconds, written = [], []
    for _ in range(syncs):
        corpus.publish(batch)
        started = time.perf_counter()
        if legacy is None:
            store.sync()
            written.append(store.last_sync.bytes_written)
        else:
            written.append(_legacy_sync(legacy, corpus, output, batch))
        seconds.append(time.perf_counter() - started)
    return {
        "variant": variant,
        "sync_p50_s": statistics.median(seconds),
        "sync_max_s": max(seconds),
        "bytes_per_sync_p50": statistics.median(written),
        "bytes_per_sync_max": max(written),
        "rss_before_syncs_mb": rss_start,
        "rss_peak_mb": rss_mb(),
    }


def _legacy_index(store: IndexStore) -> object:
    store.load()  # the whole index in memory, as workers held it before shards
    return store._index


def _legacy_sync(index: object, corpus: Corpus, output: Path, batch: int) -> int:
    import faiss

    from sinks.index.shards import write_index_file

    table = pq.read_table(
        vectors_dir(output) / SegmentKey(TOPIC, 0, corpus.next_offset - batch).filename,
        columns=["offset", "embedding"],
    )
    vectors = table.column("embedding").combine_chunks().values.to_numpy().reshape(-1, corpus.dim)
    index.add_with_ids(vectors, table.column("offset").to_numpy())  # type: ignore[attr-defined]
    path = output / "index" / "legacy-whole.faiss"
    size = write_index_file(index, path)
    assert faiss is not None
    return size


# -- the parent ---------------------------------------------------------------------


def run_child(output: Path, variant: str, args: argparse.Namespace) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        str(output),
        "--variant",
        variant,
        "--syncs",
        str(args.syncs),
        "--batch",
        str(args.batch),
        "--dim",
        str(args.dim),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def upkeep(size: int, work: Path, args: argparse.Namespace) -> dict:
    base = work / f"base-{size}"
    corpus = Corpus(base, args.dim)
    started = time.perf_counter()
    corpus.fill(size)
    IndexStore(base).rebuild()
    print(f"[{size:,}] corpus and flat index built in {time.perf_counter() - started:.1f}s")
    result: dict = {"indexed": size}
    for variant in ("shards", "rewrite"):
        copy = work / f"{variant}-{size}"
        shutil.copytree(base, copy)
        result[variant] = run_child(copy, variant, args)
        shutil.rmtree(copy)
        print(f"[{size:,}] {variant}: {json.dumps(result[variant])}")
    shutil.rmtree(base)
    return result


def search_side_by_side(size: int, work: Path, args: argparse.Namespace) -> dict:
    output = work / f"search-{size}"
    corpus = Corpus(output, args.dim)
    corpus.fill(size)
    queries = corpus.vectors(args.queries)
    truth: np.ndarray | None = None
    result: dict = {"indexed": size}
    for index_type in args.index_types.split(","):
        started = time.perf_counter()
        IndexStore(output, index_type=index_type).rebuild()
        build_s = time.perf_counter() - started
        store = IndexStore(output)
        started = time.perf_counter()
        store.load()
        load_s = time.perf_counter() - started
        latencies, found = [], []
        for query in queries:
            started = time.perf_counter()
            hits = store.search(query[None, :], 10)[0]
            latencies.append(time.perf_counter() - started)
            found.append([(h.partition, h.offset) for h in hits])
        ids = np.array([[o for _, o in row] for row in found])
        if truth is None:
            truth = ids
        overlap = [len(set(a) & set(b)) / 10 for a, b in zip(truth, ids, strict=True)]
        meta = store.meta
        assert meta is not None
        result[index_type] = {
            "build_s": build_s,
            "load_s": load_s,
            "search_p50_ms": statistics.median(latencies) * 1000,
            "recall_at_10_vs_flat": float(np.mean(overlap)),
            "recall_at_10_reported_by_rebuild": meta.recall_at_10,
            "index_bytes": sum(
                (store.directory / s.file).stat().st_size for s in store.meta.shards
            ),
        }
        print(f"[{size:,}] {index_type}: {json.dumps(result[index_type])}")
    shutil.rmtree(output)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--search-sizes", default="1000000")
    parser.add_argument("--syncs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1000, help="new vectors per sync")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--index-types", default="flat,ivf,ivf-pq", help="searched side by side")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="shards", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.variant, args.syncs, args.batch, args.dim)))
        return
    work = Path(tempfile.mkdtemp(prefix="index-scale-", dir=args.workdir))
    try:
        results = {
            "upkeep": [upkeep(int(n), work, args) for n in args.sizes.split(",") if n],
            "search": [
                search_side_by_side(int(n), work, args) for n in args.search_sizes.split(",") if n
            ],
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
