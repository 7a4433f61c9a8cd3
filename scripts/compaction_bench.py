"""Reading a nearline-like dataset of many small segments, before and after `pipeline compact`.

A nearline worker publishes one small segment per batch: at one batch a second,
86,400 files a day per partition. This writes `--segments` such segments with
the real Parquet sink (`--rows` rows each, 384-d vectors, spread over
`--partitions`), then reads every vector with pyarrow.dataset (what users do),
compacts, and reads again, in one run:

    .venv/bin/python scripts/compaction_bench.py
    .venv/bin/python scripts/compaction_bench.py --segments 86400 --json out.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.core.layout import SegmentKey, iter_segments, vectors_dir  # noqa: E402
from pipeline.core.model_info import ModelInfo  # noqa: E402
from pipeline.core.records import GoodRecord, SourceRecord  # noqa: E402
from sinks.compaction import compact  # noqa: E402
from sinks.parquet import ParquetSink  # noqa: E402


def write_segments(output: Path, segments: int, rows: int, partitions: int, dim: int) -> None:
    info = ModelInfo("bench", "/m", "sha256:bench", dim, "mean", True, 256, "fp32", "cpu")
    sink = ParquetSink(output, info)
    sink.prepare()
    rng = np.random.default_rng(0)
    next_offset = [0] * partitions
    for n in range(segments):
        partition = n % partitions
        first = next_offset[partition]
        records = [
            GoodRecord(
                SourceRecord("live", partition, o, 0, None, b"{}"), f"text {o}", f"id-{o}", None
            )
            for o in range(first, first + rows)
        ]
        vectors = rng.standard_normal((rows, dim)).astype(np.float32)
        staged = sink.stage(
            SegmentKey("live", partition, first), first + rows - 1, records, vectors, rows
        )
        assert sink.publish(staged)
        next_offset[partition] += rows


def read_all(output: Path) -> tuple[int, float]:
    started = time.perf_counter()
    table = ds.dataset(vectors_dir(output), format="parquet").to_table(
        columns=["offset", "embedding"]
    )
    return table.num_rows, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--segments", type=int, default=20_000)
    parser.add_argument("--rows", type=int, default=3, help="rows per segment")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--reads", type=int, default=3, help="reads each way; the best is kept")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    output = Path(tempfile.mkdtemp(prefix="compaction-bench-"))
    try:
        started = time.perf_counter()
        write_segments(output, args.segments, args.rows, args.partitions, args.dim)
        print(f"{args.segments} segments written in {time.perf_counter() - started:.1f}s")
        before = [read_all(output) for _ in range(args.reads)]
        report = compact(output)
        after = [read_all(output) for _ in range(args.reads)]
        rows = before[0][0]
        assert all(n == rows for n, _ in before + after), "rows changed"
        best_before = min(s for _, s in before)
        best_after = min(s for _, s in after)
        result = {
            "segments": args.segments,
            "rows": rows,
            "files_before": report.files_before,
            "files_after": len(list(iter_segments(output))),
            "compaction_s": report.seconds,
            "read_before_rows_per_s": rows / best_before,
            "read_after_rows_per_s": rows / best_after,
            "speed_up": best_before / best_after,
        }
    finally:
        shutil.rmtree(output, ignore_errors=True)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
