#!/usr/bin/env python3
"""The tokenizer on the CPU: the Rust tokenizer against pipeline.wordpiece's fast path.

Side by side in one process, on the same texts, per corpus:

  english  paragraphs of the standard library's docstrings (pipeline.corpus);
  chinese  real Chinese, Japanese and Korean text found on this machine (the UTF-8
           samples of Python's test/cjkencodings, GnuPG's zh_CN help) and any
           --file given (UTF-8 text; paragraphs, else lines);
  mixed    the two interleaved: a Chinese paragraph, then an English one.

For each: the share of texts the fast path takes (the rest go to the Rust
tokenizer, as in the worker), CPU µs per text (all threads: the Rust tokenizer
runs on several) and wall µs per text, through `Embedder.tokenize` with the fast
path and with PIPELINE_TOKENIZER=rust, and whether every id agreed. The fast path
runs twice: first with every text new to it, then again (words and whitespace-
delimited chunks remembered: a corpus whose vocabulary repeats, as real ones do).
"array" is the same fast path as the worker's tokenizer process runs it
(`wordpiece.encode_taken_flat`: every text's ids in one array, the texts it leaves
to the Rust tokenizer not counted), first and again, on a fresh instance.

    .venv/bin/python scripts/tokenize_bench.py [--model default] [--texts 20000]
        [--file FILE ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import sysconfig
import time
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.corpus import sample_texts  # noqa: E402

if TYPE_CHECKING:
    from pipeline.embedder import Embedder


FOUND_CJK = [
    *sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "test/cjkencodings/*-utf8.txt"))),
    "/usr/share/gnupg/help.zh_CN.txt",
]


def cjk_texts(files: list[str]) -> list[str]:
    texts: list[str] = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            continue
        data = path.read_text(encoding="utf-8", errors="replace")
        paragraphs = [p.strip() for p in data.split("\n\n") if len(p.strip()) > 10]
        lines = [line.strip() for line in data.splitlines() if len(line.strip()) > 10]
        texts += paragraphs if len(paragraphs) > 3 else lines
    return texts


def corpora(count: int, files: list[str]) -> dict[str, list[str]]:
    english = sample_texts(count)
    found = cjk_texts(files)
    result = {"english": english}
    if found:
        chinese = [found[i % len(found)] for i in range(count)]
        result["chinese"] = chinese
        result["mixed"] = [
            chinese[i // 2] if i % 2 else english[(i // 2) % len(english)] for i in range(count)
        ]
    return result


def timed(embedder: Embedder, texts: list[str]) -> tuple[list[list[int]], float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    ids = embedder.tokenize(texts).ids
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return ids, cpu / len(texts) * 1e6, wall / len(texts) * 1e6


def timed_array(fast: Any, texts: list[str]) -> tuple[list[list[int] | None], float]:
    """The ids as the tokenizer process gives them (None for texts it leaves to the
    Rust tokenizer) and the CPU µs a text."""
    from pipeline import wordpiece

    cpu = time.process_time()
    flat, offsets, _, others = wordpiece.encode_taken_flat(fast, texts)
    cpu = time.process_time() - cpu
    ids: list[list[int] | None] = [flat[a:b].tolist() for a, b in pairwise(offsets)]
    for i in others:
        ids[i] = None
    return ids, cpu / len(texts) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--texts", type=int, default=20_000)
    parser.add_argument("--file", action="append", default=[])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    # Imported here: scripts/overhead.py takes only the corpora, without torch.
    from tokenizers import Tokenizer

    from pipeline import wordpiece
    from pipeline.embedder import Embedder

    embedder = Embedder.load(args.model, device="cpu")
    fast = embedder._wordpiece
    if fast is None:
        raise SystemExit(f"tokenize_bench: {args.model}'s tokenizer has no fast path")
    rows: list[dict[str, Any]] = []
    for name, texts in corpora(args.texts, [*args.file, *FOUND_CJK]).items():
        embedder.tokenize(texts[:200])  # warm both paths' memos and pools alike
        fast_ids, fast_cpu, fast_wall = timed(embedder, texts)
        # Again, every word and chunk now known: a corpus whose vocabulary repeats.
        warm_ids, warm_cpu, _ = timed(embedder, texts)
        embedder._wordpiece = None
        rust_ids, rust_cpu, rust_wall = timed(embedder, texts)
        embedder._wordpiece = fast
        array = wordpiece.for_tokenizer(
            Tokenizer.from_str(embedder.tokenizer_json()), embedder.info.max_length
        )
        assert array is not None
        timed_array(array, texts[:200])
        array_ids, array_cpu = timed_array(array, texts)
        array_again_ids, array_warm_cpu = timed_array(array, texts)
        array_equal = array_ids == array_again_ids and all(
            mine is None or mine == theirs for mine, theirs in zip(array_ids, rust_ids, strict=True)
        )
        rows.append({
            "corpus": name,
            "texts": len(texts),
            "mean_chars": round(sum(map(len, texts)) / len(texts), 1),
            "taken": round(sum(map(fast.handles, texts)) / len(texts), 4),
            "rust_cpu_us": round(rust_cpu, 1),
            "fast_cpu_us": round(fast_cpu, 1),
            "fast_warm_cpu_us": round(warm_cpu, 1),
            "rust_wall_us": round(rust_wall, 1),
            "fast_wall_us": round(fast_wall, 1),
            "cpu_ratio": round(fast_cpu / rust_cpu, 3),
            "array_cpu_us": round(array_cpu, 1),
            "array_warm_cpu_us": round(array_warm_cpu, 1),
            "ids_equal": fast_ids == rust_ids == warm_ids and array_equal,
        })  # fmt: skip
    print(f"tokenizer ({args.model}), µs per text; ratio = fast CPU / Rust CPU")
    for r in rows:
        print(
            f"  {r['corpus']:<8} {r['texts']:>6} texts of {r['mean_chars']:>6} chars, "
            f"{r['taken']:.1%} taken: CPU rust {r['rust_cpu_us']:6.1f} fast "
            f"{r['fast_cpu_us']:6.1f} (ratio {r['cpu_ratio']:.2f}), again "
            f"{r['fast_warm_cpu_us']:.1f}; wall rust {r['rust_wall_us']:6.1f} fast "
            f"{r['fast_wall_us']:6.1f}; array {r['array_cpu_us']:.1f}, again "
            f"{r['array_warm_cpu_us']:.1f}; ids equal: {r['ids_equal']}"
        )
    if "chinese" not in {r["corpus"] for r in rows}:
        print("  (no Chinese text found on this machine: pass --file)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(r["ids_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
