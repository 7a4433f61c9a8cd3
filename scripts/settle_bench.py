#!/usr/bin/env python3
"""Workers started together: how long until the group settles and each one works.

One run against the real broker. A topic of `--partitions` partitions gets a backlog;
`--workers` workers (`pipeline run`, one group, one output) start at the same moment.
From each worker's own log lines (consumers.partitions.RebalanceLog: one line per
rebalance, with the partitions assigned, revoked and kept) the report gives, from the
common start: when each worker first owned partitions, how long the first one to join
held more than its share, and when the group's assignment last changed (settled). The
run ends `--hold` seconds after that, and every worker is stopped; then the output is
checked against the topic (every offset below the committed one exactly once).

    .venv/bin/python scripts/settle_bench.py [--workers 3] [--partitions 6]
        [--backlog 3000] [--model default] [--hold 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import broker, worker_log  # noqa: E402
from harness.corpora import paragraphs  # noqa: E402
from harness.worker import OFFLINE, command  # noqa: E402

from pipeline.core.config import DEFAULT_BOOTSTRAP, KafkaSettings  # noqa: E402

# Releases before the one-line log wrote "partitions assigned: [('t', 0)]" and
# "partitions revoked: [...]": read too, to run this against them side by side.
EARLIER = re.compile(
    r"^(?P<at>\S+ \S+) \S+ consumers\.partitions: partitions (?P<change>assigned|revoked): "
    r"(?P<listed>\[.*\])",
    re.MULTILINE,
)


def ownership_timeline(log: str) -> list[tuple[float, int]]:
    """(wall time, partitions owned after it) for each rebalance line of a worker."""
    changes = [
        (c.position, c.at, c.gone, c.came)
        for c in worker_log.ownership_changes(log)
        if c.kind == "rebalance"
    ]
    for line in EARLIER.finditer(log):
        listed = set(worker_log.LISTED_PARTITION.findall(line["listed"]))
        gone, came = (listed, set()) if line["change"] == "revoked" else (set(), listed)
        changes.append((line.start(), line["at"], gone, came))
    owned: set[Any] = set()
    timeline = []
    for _, at, gone, came in sorted(changes, key=lambda change: change[0]):
        owned = (owned - gone) | came
        timeline.append((worker_log.stamp(at), len(owned)))
    return timeline


def one_run(kafka: KafkaSettings, args: Any, work: Path) -> dict[str, Any]:
    topic = broker.new_topic(kafka, args.partitions, prefix="settle")
    group = f"settle-{uuid.uuid4().hex[:8]}"
    texts = paragraphs(args.backlog)
    broker.publish(kafka, topic, ({"id": str(n), "text": t} for n, t in enumerate(texts)),
                   args.partitions)  # fmt: skip
    output = work / "out"
    argv = command(kafka, topic, group, output, "--model", args.model, until_end=False)
    logs = [work / f"w{n}.log" for n in range(args.workers)]
    started = time.time()
    workers = [
        subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT,
                         env={**os.environ, **OFFLINE})
        for log in logs
    ]  # fmt: skip
    try:
        settled_at = None
        deadline = time.monotonic() + args.max_seconds
        while time.monotonic() < deadline:
            timelines = [ownership_timeline(p.read_text()) for p in logs]
            last = max((t for tl in timelines for t, _ in tl), default=None)
            owners = sum(1 for tl in timelines if tl and tl[-1][1] > 0)
            if last is not None and owners == args.workers and time.time() - last > args.hold:
                settled_at = last
                break
            if any(proc.poll() is not None for proc in workers):
                raise SystemExit(f"settle_bench: a worker exited; see {work}")
            time.sleep(0.5)
    finally:
        for proc in workers:
            proc.send_signal(signal.SIGTERM)
        for proc in workers:
            proc.wait(timeout=120)
    timelines = [ownership_timeline(p.read_text()) for p in logs]
    share = -(-args.partitions // args.workers)
    first_owned = [tl[0][0] - started if tl else None for tl in timelines]
    joined_first = min(range(args.workers), key=lambda n: timelines[n][0][0])
    over_share = [t for t, n in timelines[joined_first] if n > share]
    held_until = None
    for t, n in timelines[joined_first]:
        if n <= share and over_share and t >= over_share[0]:
            held_until = t
            break
    audit = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "--bootstrap-servers", kafka.bootstrap_servers,
         "audit", "--output", str(output), "--group", group, "--topic", topic],
        capture_output=True, text=True,
    )  # fmt: skip
    result = {
        "workers": args.workers,
        "partitions": args.partitions,
        "first_owned_s": [None if v is None else round(v, 2) for v in first_owned],
        "first_held_over_share_s": (
            round(held_until - over_share[0], 2) if held_until and over_share else 0.0
        ),
        "settled_s": None if settled_at is None else round(settled_at - started, 2),
        "rebalance_lines": [len(tl) for tl in timelines],
        "exit_codes": [proc.returncode for proc in workers],
        "audit_exit": audit.returncode,  # 0: every committed offset exactly once
    }
    broker.delete(kafka, [topic, f"{topic}.dlq"], [group])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--backlog", type=int, default=3000)
    parser.add_argument("--model", default="default")
    parser.add_argument("--hold", type=float, default=20.0, help="stable this long: settled")
    parser.add_argument("--max-seconds", type=float, default=300.0)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--bootstrap-servers", default=DEFAULT_BOOTSTRAP)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    kafka = KafkaSettings(bootstrap_servers=args.bootstrap_servers)
    results = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="settle-") as work:
            result = one_run(kafka, args, Path(work))
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
