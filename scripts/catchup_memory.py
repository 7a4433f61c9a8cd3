#!/usr/bin/env python3
"""What a catch-up batch leaves behind in a worker that is otherwise nearline.

The embedder alone (no Kafka), laid out as a worker lays it out: small batches
of 1-3 texts as a nearline worker meets them, then, `--rounds` times, one batch
of `--catch-up` texts (a worker's batch after it fell behind) followed by more
small ones. After each step the allocator's free pages are given back, as the
worker's embed stage does after every batch, and the resident anonymous memory
is read: what stays is what the catch-up left for the rest of the run.

Each variant runs in a process of its own: `default` (glibc's arenas as they
come: one per thread that allocates under contention, up to 8 per core) and
`one-arena` (every thread on the main heap, as `pipeline run` sets up with
pipeline.core.host.use_one_malloc_arena). "thread heaps" is what the threads' own
heaps hold resident (mappings on 64 MiB boundaries).

    .venv/bin/python scripts/catchup_memory.py [--catch-up 4096] [--rounds 3]
        [--variants default,one-arena] [--model default] [--precision fp32]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_HEAP = 64 << 20


def resident_mb() -> tuple[int, int]:
    """(anonymous resident MB, of it in glibc's thread heaps), after a trim."""
    from pipeline.core.host import release_free_memory

    release_free_memory()
    anon = heaps = 0
    in_heap = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            start = int(fields[0].split("-")[0], 16)
            anonymous = len(fields) == 5
            in_heap = anonymous and start % _HEAP == 0
        elif fields[0] == "Anonymous:":
            anon += int(fields[1])
            heaps += int(fields[1]) if in_heap else 0
    return anon >> 10, heaps >> 10


def child(args: argparse.Namespace) -> None:
    from pipeline.core.corpus import sample_texts
    from pipeline.core.host import plan_cpu, usable_cpus, use_one_malloc_arena
    from pipeline.model.embedder import Embedder

    if args.child == "one-arena":
        use_one_malloc_arena()
    embedder = Embedder.load_planned(args.model, args.precision, plan_cpu("cpu", usable_cpus()))
    texts = sample_texts(100_000)
    rng = random.Random(0)
    position = 0

    def nearline(batches: int) -> None:
        nonlocal position
        for _ in range(batches):
            count = rng.choice([1, 1, 2, 3])
            batch = [texts[(position + i) % len(texts)] for i in range(count)]
            position += count
            embedder.embed_tokens(embedder.tokenize(batch))
            resident_mb()

    nearline(300)
    steps = [{"step": "nearline", "seconds": 0.0, "mb": resident_mb()}]
    for round_no in range(args.rounds):
        start = rng.randrange(len(texts))
        batch = [texts[(start + i) % len(texts)] for i in range(args.catch_up)]
        began = time.perf_counter()
        embedder.embed_tokens(embedder.tokenize(batch))
        seconds = time.perf_counter() - began
        nearline(100)
        steps.append({"step": f"catch-up {round_no + 1}", "seconds": seconds, "mb": resident_mb()})
    print(json.dumps(steps))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--catch-up", type=int, default=4096, help="texts in a catch-up batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="default,one-arena")
    parser.add_argument("--model", default="default")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    print(f"resident anonymous MB after {args.catch_up}-text catch-up batches (thread heaps)")
    for variant in args.variants.split(","):
        command = [sys.executable, __file__, "--child", variant, *sys.argv[1:]]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        steps = json.loads(done.stdout.strip().splitlines()[-1])
        base = steps[0]["mb"][0]
        cells = [f"{s['step']} {s['mb'][0]} ({s['mb'][1]})" for s in steps]
        took = " ".join(f"{s['seconds']:.0f}s" for s in steps[1:])
        print(f"  {variant:<10} " + ", ".join(cells))
        print(f"  {'':<10} left behind: {steps[-1]['mb'][0] - base:+d} MB; catch-ups took {took}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
