"""The command: which seeds, which scenarios, the harness's broker, the summary."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tiny_model import ensure_tiny_model

from chaos.broker import Broker
from chaos.common import CACHE, REPO, HarnessError
from chaos.plans import SCENARIOS, scenario_for
from chaos.seeds import SeedResult, SeedRun


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            low, high = part.split("-", 1)
            seeds += range(int(low), int(high) + 1)
        else:
            seeds.append(int(part))
    if not seeds:
        raise argparse.ArgumentTypeError(f"no seeds in {text!r}")
    return seeds


def parse_scenarios(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}"
        )
    return names


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Seeded chaos scenarios against a real broker, each checked independently.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--seeds", type=parse_seeds, default=parse_seeds("1-7"))
    parser.add_argument(
        "--scenario",
        type=parse_scenarios,
        default=None,
        help=f"comma-separated, cycled over the seeds [default: by seed: {', '.join(SCENARIOS)}]",
    )
    parser.add_argument(
        "--write-mode",
        choices=["append", "upsert"],
        default="append",
        help="upsert: every worker runs with --write-mode upsert; records are versions of a "
        "bounded pool of documents (updates, tombstones, re-adds), checked against "
        "DIR/current, and each seed ends with `pipeline compact --purge` and the check again",
    )
    parser.add_argument(
        "--no-purge",
        dest="purge",
        action="store_false",
        help="upsert mode: end each seed without `pipeline compact --purge` and its check "
        "(purge: %(default)s)",
    )
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        metavar="N",
        help="chunk mode: every worker runs with --chunk-tokens N; the corpus adds long "
        "records (3-20 KB of this machine's English and Chinese texts), cut into many "
        "chunks, and the check requires each record's chunks complete, in one segment, "
        "each the record's text[char_start:char_end], each indexed once, and `pipeline "
        "audit` to exit 0",
    )
    parser.add_argument(
        "--chunk-overlap",
        type=int,
        default=None,
        metavar="M",
        help="with --chunk-tokens: every worker runs with --chunk-overlap M "
        "(None: the worker's default, 0)",
    )
    parser.add_argument("--keep-going", action="store_true", help="run every seed after a failure")
    parser.add_argument("--json", type=Path, default=None, help="write every result here")
    parser.add_argument("--port", type=int, default=19092, help="the harness broker's port")
    parser.add_argument("--kafka-home", type=Path, default=CACHE / "chaos-kafka")
    parser.add_argument("--work-dir", type=Path, default=None, help="[default: a new temp dir]")
    parser.add_argument("--model", type=Path, default=None, help="[default: the tiny model]")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO"])
    parser.add_argument("--bulk-timeout-s", type=float, default=240.0)
    parser.add_argument("--keep-broker", action="store_true", help="leave the broker running")
    parser.add_argument("--keep-topics", action="store_true", help="do not delete seed topics")
    parser.add_argument("-v", "--verbose", action="store_true", help="print events as they happen")
    args = parser.parse_args(argv)
    if args.chunk_overlap is not None and args.chunk_tokens is None:
        parser.error("--chunk-overlap needs --chunk-tokens")
    if args.chunk_tokens is not None and args.chunk_tokens < 1:
        parser.error("--chunk-tokens must be at least 1")
    overlap = args.chunk_overlap or 0
    if args.chunk_tokens is not None and not 0 <= overlap < args.chunk_tokens:
        parser.error("--chunk-overlap must be at least 0 and smaller than --chunk-tokens")
    return args


def code_version() -> str:
    """The commit under test, and whether the working tree differs from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head or 'unknown'}{' (modified)' if dirty else ''}"


def summarize(results: list[SeedResult], seconds: float) -> dict[str, Any]:
    failed = [r for r in results if not r.ok]
    return {
        "seeds": len(results),
        "passed": len(results) - len(failed),
        "failed": [r.seed for r in failed],
        "lost": sum(r.lost for r in results),
        "doubled": sum(r.doubled for r in results),
        "phantom": sum(r.phantom for r in results),
        "misrouted": sum(r.misrouted for r in results),
        "mismatched": sum(r.mismatched for r in results),
        "records": sum(r.records for r in results),
        "audit_disagreements": [
            r.seed for r in results if r.audit.get("present") and not r.audit.get("agrees")
        ],
        **(_documents_summary(results) if any(r.write_mode == "upsert" for r in results) else {}),
        **(_chunks_summary(results) if any(r.chunking for r in results) else {}),
        "seconds": round(seconds, 1),
        # How many seeds exercised each path (from the workers' logs).
        "exercised_seeds": dict(
            sum((Counter({k: 1 for k, n in r.exercised.items() if n}) for r in results), Counter())
        ),
    }


def _documents_summary(results: list[SeedResult]) -> dict[str, Any]:
    """Upsert mode's totals: documents live, deletions, and the view's verdicts."""
    return {
        "write_mode": "upsert",
        "documents_live": sum(r.documents.get("live", 0) for r in results),
        "deletions": sum(r.documents.get("deletions", 0) for r in results),
        "view_lost": sum(r.view_lost for r in results),
        "view_extra": sum(r.view_extra for r in results),
        "view_stale": sum(r.view_stale for r in results),
        "purge_failed": [r.seed for r in results if r.purge and not r.purge.get("ok")],
    }


def _chunks_summary(results: list[SeedResult]) -> dict[str, Any]:
    """Chunk mode's totals: chunk rows, records cut in several, the chunk verdicts."""
    totals: Counter[str] = Counter()
    for r in results:
        totals.update(
            {k: v for k, v in r.chunks.items() if isinstance(v, int) and k != "max_chunk_count"}
        )
    return {
        "chunking": results[0].chunking,
        "chunks": dict(totals),
        "max_chunk_count": max((r.chunks.get("max_chunk_count", 0) for r in results), default=0),
    }


def print_failure(result: SeedResult) -> None:
    if result.harness_error:
        print(f"    harness error: {result.harness_error}")
    for problem in result.problems:
        print(f"    {problem[:600]}")
    print(f"    work dir (events.log, logs/): {result.work_dir}")


@contextlib.contextmanager
def running_broker(broker: Broker, keep: bool) -> Iterator[Broker]:
    broker.start()
    try:
        yield broker
    finally:
        if not keep:
            with contextlib.suppress(HarnessError, subprocess.TimeoutExpired):
                broker.stop()


def run_seeds(args: argparse.Namespace, broker: Broker, model: Path, root: Path) -> list[Any]:
    results: list[SeedResult] = []
    args.keep_evidence = args.keep_topics  # no broker wipe once a topic is worth keeping
    for index, seed in enumerate(args.seeds):
        scenario = scenario_for(seed, args.scenario, index)
        run = SeedRun(seed, scenario, broker, model, root, args)
        result = run.run()
        results.append(result)
        print(result.line(), flush=True)
        args.keep_evidence = args.keep_evidence or not result.ok or args.keep_topics
        if result.ok:
            if not args.keep_topics:
                run.clean_up()
        else:
            print_failure(result)
            if not args.keep_going:
                break
        if args.json:
            write_json(args.json, results, None)
    return results


def write_json(path: Path, results: list[SeedResult], summary: dict[str, Any] | None) -> None:
    payload = {"summary": summary, "results": [asdict(r) for r in results]}
    path.write_text(json.dumps(payload, indent=1, default=str))


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    root = args.work_dir or Path(f"/tmp/chaos-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    root.mkdir(parents=True, exist_ok=True)
    model = ensure_tiny_model(args.model)
    broker = Broker(args.port, args.kafka_home)
    print(f"chaos: broker {broker.bootstrap} (home {broker.home}), work dir {root}", flush=True)
    started, code = time.monotonic(), code_version()
    print(f"chaos: code under test {code}", flush=True)
    try:
        with running_broker(broker, args.keep_broker):
            results = run_seeds(args, broker, model, root)
    except HarnessError as exc:
        print(f"chaos: error: {exc}", file=sys.stderr)
        return 2
    summary = summarize(results, time.monotonic() - started)
    summary["code"] = {"start": code, "end": code_version()}
    print("summary: " + json.dumps(summary), flush=True)
    if args.json:
        write_json(args.json, results, summary)
    failed = summary["failed"] or len(results) < len(args.seeds)
    if failed:
        print(f"chaos: FAILED; work dir {root}", flush=True)
    return 1 if failed else 0
