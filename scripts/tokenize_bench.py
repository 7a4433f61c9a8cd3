#!/usr/bin/env python3
"""The tokenizer by measurement: pipeline.model.tokenize.wordpiece's hand-written path against the
Rust tokenizer, on corpora it has not seen, cold and warm, side by side in one run.

Corpora (built on this machine, nothing downloaded):

  english  paragraphs of the standard library's docstrings (pipeline.core.corpus);
  chinese  the Simplified and Traditional Chinese translations of this machine's
           gettext catalogues (/usr/share/locale/zh_*), else Python's CJK test files;
  code     runs of four lines of the standard library's source;
  logs     generated log lines: timestamps, hex request ids, IPs, paths (a new word
           in nearly every field: the hand-written path's worst case);
  mixed    a Chinese and an English text in turn, and code-switched lines.

Each corpus is split in halves. "cold" is the first half on a fresh tokenizer
(the hand-written path's start-up, its tables, is timed apart as "setup");
"warm" is the second half after it (a corpus whose words recur, as real ones
do); "again" the second half once more.

Where: "in-process" is CPU µs per text on one thread (the poll loop's cost when
the tokenizer process is off). "process xN" is the worker's tokenizer process
(consumers.tokenize_process), N of them each taking a slice of every poll of
1,024 records: wall µs per text from the first poll submitted to the last answer,
parsing included, as the worker sees it. Every mode's ids are compared with the
Rust tokenizer's.

    .venv/bin/python scripts/tokenize_bench.py [--model default] [--texts 8000]
        [--processes 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

POLL = 1024

from harness.corpora import CORPORA  # noqa: E402

# ------------------------------------------------------------------ measurements


def rust_in_process(rust: Any, texts: list[str]) -> tuple[list[list[int]], float]:
    started = time.process_time()
    ids = [e.ids for e in rust.encode_batch(texts, add_special_tokens=True)]
    return ids, _per_text_us(time.process_time() - started, texts)


def fast_in_process(fast: Any, rust: Any, texts: list[str]) -> tuple[list[list[int]], float]:
    from pipeline.model.tokenize import batches

    started = time.process_time()
    flat, offsets, _, _ = batches.encode_taken_flat(fast, texts, rust)
    seconds = time.process_time() - started
    ids = [flat[a:b].tolist() for a, b in pairwise(offsets.tolist())]
    return ids, _per_text_us(seconds, texts)


def through_processes(
    tokenizer_json: str, max_length: int, fast_path: bool, processes: int, halves: list[list[str]]
) -> tuple[float, list[tuple[list[list[int]], float]]]:
    """Start-up ms, and per half: (ids, wall µs a text) through `processes` children."""
    from consumers.tokenize_process import TokenizerProcess
    from pipeline.core.records import SourceRecord

    started = time.perf_counter()
    children = [
        TokenizerProcess(tokenizer_json, max_length, fast_path=fast_path) for _ in range(processes)
    ]
    for child in children:
        child.ready()
    setup_ms = (time.perf_counter() - started) * 1000
    results = []
    try:
        for texts in halves:
            values = [json.dumps({"text": t}, ensure_ascii=False).encode() for t in texts]
            ids: list[list[int]] = []
            began = time.perf_counter()
            for start in range(0, len(values), POLL):
                poll = values[start : start + POLL]
                share = -(-len(poll) // processes)
                slices = [poll[i : i + share] for i in range(0, len(poll), share)]
                for child, part in zip(children, slices, strict=False):
                    child.submit_values(part)
                for child, part in zip(children, slices, strict=False):
                    sources = [SourceRecord("t", 0, n, 0, None, v) for n, v in enumerate(part)]
                    _, part_ids, _ = child.parsed_result(sources)
                    ids += [list(map(int, one)) for one in part_ids]
            results.append((ids, _per_text_us(time.perf_counter() - began, texts)))
    finally:
        for child in children:
            child.close()
    return setup_ms, results


def _per_text_us(seconds: float, texts: list[str]) -> float:
    return seconds / max(1, len(texts)) * 1e6


def measure(name: str, texts: list[str], spec: Any, processes: list[int]) -> dict[str, Any]:
    from pipeline.model.tokenize import fast_path

    half = len(texts) // 2
    cold, warm = texts[:half], texts[half:]
    rust = spec.tokenizer.backend(spec.max_length)
    row: dict[str, Any] = {"corpus": name, "texts": len(texts)}
    row["mean_chars"] = round(sum(map(len, texts)) / len(texts), 1)
    expected_cold, row["rust_cold_us"] = rust_in_process(rust, cold)
    expected_warm, row["rust_warm_us"] = rust_in_process(rust, warm)
    started = time.perf_counter()
    fast = fast_path.for_tokenizer(rust, spec.max_length)
    if fast is not None:
        fast.unicode_rules()
    row["fast_setup_ms"] = round((time.perf_counter() - started) * 1000, 1)
    equal = True
    if fast is not None:
        row["taken"] = round(sum(fast.handles_many(texts)) / len(texts), 4)
        got, row["fast_cold_us"] = fast_in_process(fast, rust, cold)
        equal &= got == expected_cold
        got, row["fast_warm_us"] = fast_in_process(fast, rust, warm)
        equal &= got == expected_warm
        got, row["fast_again_us"] = fast_in_process(fast, rust, warm)
        equal &= got == expected_warm
    tokenizer_json = rust.to_str()
    for count in processes:
        for mode, use_fast_path in (("rust", False), ("fast", True)):
            if use_fast_path and fast is None:
                continue
            setup_ms, halves = through_processes(
                tokenizer_json, spec.max_length, use_fast_path, count, [cold, warm]
            )
            row[f"process{count}_{mode}_setup_ms"] = round(setup_ms)
            for label, (ids, us), expected in zip(
                ("cold", "warm"), halves, (expected_cold, expected_warm), strict=True
            ):
                row[f"process{count}_{mode}_{label}_us"] = round(us, 1)
                equal &= ids == expected
    row["ids_equal"] = equal
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}


def render(rows: list[dict[str, Any]], processes: list[int]) -> list[str]:
    lines = [
        "µs per text (in-process: CPU, one thread; process xN: wall, parsing included); "
        "cold / warm",
        f"{'corpus':<9}{'chars':>6}  {'rust':>13}  {'hand-written':>13}  {'again':>5}  "
        + "  ".join(
            f"{'x' + str(n) + ' rust':>13}  {'x' + str(n) + ' hand':>13}" for n in processes
        )
        + "  setup ms  ids",
    ]
    for r in rows:
        cells = [
            f"{r['corpus']:<9}{r['mean_chars']:>6.0f}",
            f"{r['rust_cold_us']:>6.1f}/{r['rust_warm_us']:<6.1f}",
            f"{r.get('fast_cold_us', 0):>6.1f}/{r.get('fast_warm_us', 0):<6.1f}",
            f"{r.get('fast_again_us', 0):>5.1f}",
        ]
        for n in processes:
            cells.append(
                f"{r[f'process{n}_rust_cold_us']:>6.1f}/{r[f'process{n}_rust_warm_us']:<6.1f}"
            )
            fast_cold = r.get(f"process{n}_fast_cold_us", 0)
            cells.append(f"{fast_cold:>6.1f}/{r.get(f'process{n}_fast_warm_us', 0):<6.1f}")
        cells.append(f"{r.get('fast_setup_ms', 0):>8.0f}  {'yes' if r['ids_equal'] else 'NO'}")
        lines.append("  ".join(cells))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--texts", type=int, default=8000)
    parser.add_argument("--processes", type=int, default=2, help="the most children to try")
    parser.add_argument("--corpus", action="append", choices=sorted(CORPORA), default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from pipeline.model.spec import ModelSpec

    spec = ModelSpec.read(args.model)
    processes = sorted({1, max(1, args.processes)})
    rows = []
    for name in args.corpus or list(CORPORA):
        texts = CORPORA[name](args.texts)
        if texts:
            rows.append(measure(name, texts, spec, processes))
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(f"tokenizer of {spec.name}, {args.texts} texts a corpus")
    print("\n".join(render(rows, processes)))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(r["ids_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
