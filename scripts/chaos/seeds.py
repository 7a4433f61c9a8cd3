"""One seed from start to verdict: publish, run the plan, finish with --until-end,
check."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tiny_model import ensure_tiny_model

from chaos import upsert
from chaos.broker import Broker
from chaos.check import (
    RowScan,
    Verdict,
    check_commits,
    check_index,
    check_java,
    check_records,
    dead_letters,
    end_offsets,
    group_committed,
    index_entries,
    parquet_rows,
    read_topic,
    run_audit,
    topic_exists,
)
from chaos.chunks import check_chunks
from chaos.common import BATCH_SIZES, EXERCISED, SLOW_BATCH_SIZES, TMP_SUFFIX, HarnessError
from chaos.fleet import Fleet, Trickle, WorkerProc, WorkerSettings
from chaos.long_texts import LongTexts, model_length
from chaos.plans import EventLog, Step, make_plan
from chaos.records import (
    Documents,
    Ids,
    JavaIds,
    Published,
    Target,
    publish_java,
    publish_python,
)


@dataclass
class SeedResult:
    seed: int
    scenario: str
    partitions: int
    events: list[str]
    steps: int = 0
    plan: list[str] = field(default_factory=list)
    records: int = 0
    bad_records: int = 0
    rows: int = 0
    java_aborted: int = 0
    lost: int = 0
    doubled: int = 0
    phantom: int = 0
    misrouted: int = 0
    mismatched: int = 0
    dead_letter_repeats: int = 0
    index: dict[str, int] = field(default_factory=dict)
    audit: dict[str, Any] = field(default_factory=dict)
    workers: dict[str, Any] = field(default_factory=dict)
    exercised: dict[str, int] = field(default_factory=dict)
    temp_files_left: int = 0
    quarantined: int = 0
    problems: list[str] = field(default_factory=list)
    harness_error: str | None = None
    seconds: float = 0.0
    work_dir: str = ""
    write_mode: str = "append"
    # Upsert mode: documents live, deletions, updated, re-added, the view's and the
    # index's verdicts, what the purge did and the audit after it.
    documents: dict[str, Any] = field(default_factory=dict)
    view_lost: int = 0
    view_extra: int = 0
    view_stale: int = 0
    purge: dict[str, Any] = field(default_factory=dict)
    # Chunk mode (`--chunk-tokens`): its settings, and the chunk rows' verdict
    # (chaos.chunks.ChunkVerdict.summary, and the kinds of texts published).
    chunking: dict[str, int] = field(default_factory=dict)
    chunks: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems and self.harness_error is None

    def line(self) -> str:
        status = "OK" if self.ok else ("ERROR" if self.harness_error else "FAIL")
        audit = (
            "-"
            if not self.audit.get("present")
            else ("agree" if self.audit.get("agrees") else "DISAGREE")
        )
        documents = ""
        if self.write_mode == "upsert":
            d, purge = self.documents, self.purge
            purged = "-" if not purge else ("ok" if purge.get("ok") else "FAIL")
            documents = (
                f"docs={d.get('live', 0)} (deleted {d.get('deletions', 0)}, updated "
                f"{d.get('updated', 0)}, re-added {d.get('readded', 0)}) view "
                f"lost={self.view_lost} extra={self.view_extra} stale={self.view_stale} "
                f"purge={purged} "
            )
        chunks = ""
        if self.chunking:
            c = self.chunks
            chunks = (
                f"chunks={c.get('rows', 0)} (records cut {c.get('multi', 0)}, max "
                f"{c.get('max_chunk_count', 0)}) incomplete={c.get('incomplete', 0)} "
                f"split={c.get('split', 0)} "
            )
        return (
            f"seed {self.seed:>3} {self.scenario:<14} p={self.partitions} "
            f"events={self.steps:>2} records={self.records:>5} (bad {self.bad_records}, "
            f"aborted {self.java_aborted}) lost={self.lost} doubled={self.doubled} "
            f"phantom={self.phantom} audit={audit} {documents}{chunks}"
            f"{self.seconds:5.1f}s {status}"
        )


class SeedRun:
    """Publishes, runs the plan, finishes in bulk mode and checks, for one seed."""

    def __init__(
        self, seed: int, scenario: str, broker: Broker, model: Path, root: Path, args: Any
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.plan = make_plan(seed, scenario)
        self.broker = broker
        self.args = args
        self.dir = root / f"seed-{seed:03d}-{scenario}"
        shutil.rmtree(self.dir, ignore_errors=True)
        (self.dir / "logs").mkdir(parents=True)
        suffix = uuid.uuid4().hex[:6]
        self.topic = f"chaos-{seed}-{suffix}"
        self.group = f"chaos-g-{seed}-{suffix}"
        self.output = self.dir / "out"
        self.partitions = self.rng.randint(2, 4)
        self.events = EventLog(self.dir / "events.log", echo=args.verbose)
        self.published = Published()
        self.ids = Ids(seed)
        self.upsert = getattr(args, "write_mode", "append") == "upsert"
        self.docs: Documents | None = None
        if self.upsert:  # its own generator: the plan and the rest draw as in append mode
            sizes = (40, 120) if self.plan.slow else (120, 450)
            self.docs = Documents(seed, random.Random(seed * 104_729 + 3).randint(*sizes))
        self.java_ids = JavaIds()
        if self.plan.slow:
            model = ensure_tiny_model(variant="slow")
        # Chunk mode: workers run with --chunk-tokens, and the corpus has long records.
        self.chunk_tokens: int | None = getattr(args, "chunk_tokens", None)
        self.chunk_overlap: int | None = getattr(args, "chunk_overlap", None)
        self.corpus: LongTexts | None = None
        if self.chunk_tokens is not None:
            self.corpus = LongTexts(model, self.chunk_tokens, self.chunk_overlap or 0)
        self.target = Target(
            broker.bootstrap,
            self.topic,
            self.partitions,
            self.plan.slow,
            self.plan.bad_ratio,
            self.corpus,
        )
        self.fleet = Fleet(self._worker_settings(model), self.dir / "logs", self.events)
        self.result = SeedResult(
            seed,
            scenario,
            self.partitions,
            [],
            steps=sum(1 for s in self.plan.steps if s.action not in ("sleep", "ready")),
            plan=[str(s) for s in self.plan.steps],
            work_dir=str(self.dir),
            write_mode="upsert" if self.upsert else "append",
        )
        if self.chunk_tokens is not None:
            self.result.chunking = {
                "tokens": self.chunk_tokens,
                "overlap": self.chunk_overlap or 0,
            }
        self.trickle: Trickle | None = None

    def _worker_settings(self, model: Path) -> WorkerSettings:
        rng = self.rng
        mixed = rng.random() < 0.3  # a rolling change: workers with different batch sizes
        choices = SLOW_BATCH_SIZES if self.plan.slow else BATCH_SIZES
        sizes = choices if mixed else (rng.choice(choices),)
        return WorkerSettings(
            topic=self.topic,
            group=self.group,
            output=self.output,
            model=model,
            bootstrap=self.broker.bootstrap,
            log_level=self.args.log_level,
            batch_sizes=sizes,
            poll_timeout_ms=rng.choice([100, 250, 500]),
            max_in_flight=rng.choice([1, 2, 2, 3]),
            index_sync_interval_s=rng.choice([1.0, 5.0, 30.0]),
            failpoints=self.plan.failpoints,
            write_mode="upsert" if self.upsert else "append",
            view_sync_interval_s=rng.choice([0.5, 2.0, 5.0]) if self.upsert else None,
            chunk_tokens=self.chunk_tokens,
            chunk_overlap=self.chunk_overlap,
        )

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> SeedResult:
        started = time.monotonic()
        try:
            self._create_topic()
            self._publish_backlog()
            self._run_plan()
            self._finish_in_bulk()
            self._check()
        except HarnessError as exc:
            self.result.harness_error = str(exc)
        except Exception as exc:  # a harness bug: report it, never a silent pass
            self.result.harness_error = f"{type(exc).__name__}: {exc}"
        finally:
            if self.trickle is not None and self.trickle.is_alive():
                self.trickle.finish()
            self.fleet.kill_all()
            self.result.seconds = time.monotonic() - started
            self.result.events = list(self.events.lines)
        self._save()
        return self.result

    def _create_topic(self) -> None:
        from kafka import KafkaAdminClient
        from kafka.admin import NewTopic

        if self.plan.fresh_broker and self.args.keep_evidence:
            self.events.write("fresh broker skipped: an earlier seed failed, its topics stay")
        elif self.plan.fresh_broker:
            self.broker.wipe()
            self.events.write("broker wiped: a fresh broker, no internal topics yet")
        admin = KafkaAdminClient(bootstrap_servers=self.broker.bootstrap)
        try:
            admin.create_topics([NewTopic(self.topic, self.partitions, 1)])
        finally:
            admin.close()
        mode = f"upsert mode ({len(self.docs.pool)} document ids), " if self.docs else ""
        if self.corpus is not None:
            mode += (
                f"chunk mode (--chunk-tokens {self.chunk_tokens} --chunk-overlap "
                f"{self.chunk_overlap or 0}; long texts up to {self.corpus.budget} tokens), "
            )
        self.events.write(
            f"topic {self.topic} ({self.partitions} partitions), group {self.group}, {mode}"
            f"plan {[str(s) for s in self.plan.steps]}, bulk {self.plan.bulk_workers} "
            f"(stop first: {self.plan.stop_before_bulk}, "
            f"broker restart: {self.plan.restart_during_bulk}, "
            f"fresh broker: {self.plan.fresh_broker})"
        )

    def _publish(self, rng: random.Random, count: int) -> None:
        codec = publish_python(self.target, rng, self.ids, count, self.published, self.docs)
        self.events.write(f"published {count} records ({codec})")

    def _publish_java(self, rng: random.Random) -> None:
        done = publish_java(
            self.broker, self.topic, self.partitions, rng, self.java_ids, self.published
        )
        if done is not None:
            self.events.write(f"java producer: {done}")

    def _publish_backlog(self) -> None:
        target = self.rng.randint(200, 400) if self.plan.slow else self.rng.randint(300, 1500)
        sent = 0
        while sent < target:
            chunk = min(target - sent, self.rng.randint(50, 600))
            self._publish(self.rng, chunk)
            sent += chunk
        if self.plan.scenario == "foreign" or self.rng.random() < 0.5:
            self._publish_java(self.rng)

    def _run_plan(self) -> None:
        chunk = (1, 6) if self.plan.slow else (5, 60)
        self.trickle = Trickle(self._publish, self.seed, chunk)
        self.trickle.start()
        for step in self.plan.steps:
            self._step(step)
            self.fleet.reap()
            if self.trickle.error is not None:
                raise HarnessError(f"publishing while workers run failed: {self.trickle.error}")
        self.trickle.finish()
        if self.trickle.error is not None:
            raise HarnessError(f"publishing while workers run failed: {self.trickle.error}")

    def _step(self, step: Step) -> None:
        rng, fleet = self.rng, self.fleet
        if step.action in ("start", "join"):
            fleet.start(int(step.arg), rng)
        elif step.action == "ready":
            fleet.wait_ready(fleet.live())
        elif step.action == "sleep":
            time.sleep(step.arg)
        elif step.action in ("term", "kill"):
            self._signal(signal.SIGTERM if step.action == "term" else signal.SIGKILL)
        elif step.action in ("stall", "hiccup"):
            self._stall(step.arg)
        elif step.action == "broker":
            self._restart_broker()
        elif step.action == "publish":
            self._publish(rng, int(step.arg))
        elif step.action == "java":
            self._publish_java(rng)
        elif step.action == "damage":
            self._damage()
        else:
            raise HarnessError(f"unknown step {step}")

    def _signal(self, sig: signal.Signals) -> None:
        victim = self.fleet.pick(self.rng)
        if victim is None:
            self.events.write(f"{sig.name}: no live worker, skipped")
            return
        self.fleet.send(victim, sig)

    def _stall(self, seconds: float) -> None:
        victim = self.fleet.pick(self.rng)
        if victim is None:
            self.events.write("stall: no live worker, skipped")
            return
        self.fleet.send(victim, signal.SIGSTOP)
        time.sleep(seconds)
        self.fleet.send(victim, signal.SIGCONT)

    def _damage(self) -> None:
        """Damages one published segment in place, and leaves a dead host's temp file."""
        segments = sorted((self.output / "vectors").glob("*.parquet"))
        if not segments:
            self.events.write("damage: no segment yet, skipped")
            return
        victim = self.rng.choice(segments)
        size = victim.stat().st_size
        if self.rng.random() < 0.5:
            os.truncate(victim, self.rng.randint(0, size // 2))
            how = "truncated"
        else:
            with open(victim, "r+b") as fh:  # the footer and its length: unreadable
                fh.seek(max(0, size - 64))
                fh.write(bytes(min(64, size)))
            how = "footer zeroed"
        stale = victim.with_name(f".{victim.name}.1.gone-host.4242.dead{TMP_SUFFIX}")
        stale.write_bytes(b"half a file from a container that no longer exists")
        week_ago = time.time() - 7 * 86_400
        os.utime(stale, (week_ago, week_ago))
        self.events.write(f"damage: {victim.name} {how} (was {size} bytes); stale {stale.name}")

    def _restart_broker(self) -> None:
        if self.trickle is not None:
            self.trickle.pause()
        self.events.write("broker restart: begin")
        self.broker.restart()
        self.events.write("broker restart: done")
        if self.trickle is not None:
            self.trickle.resume()

    def _finish_in_bulk(self) -> None:
        fleet, plan = self.fleet, self.plan
        if plan.stop_before_bulk:
            self._stop_workers(fleet.live())
        bulk = fleet.start(plan.bulk_workers, self.rng, until_end=True)
        if plan.restart_during_bulk:
            fleet.wait_ready(bulk)
            time.sleep(self.rng.uniform(0.5, 3))
            self._restart_broker()
        stuck = fleet.wait(bulk, self.args.bulk_timeout_s)
        if stuck:
            names = [w.name for w in stuck]
            self.result.problems.append(
                f"--until-end did not finish within {self.args.bulk_timeout_s:.0f}s: {names}"
            )
        fleet.terminate_all()
        self._judge_exits()

    def _stop_workers(self, workers: list[WorkerProc]) -> None:
        for worker in workers:
            if worker.stopped:
                self.fleet.send(worker, signal.SIGCONT)
            self.fleet.send(worker, signal.SIGTERM)
        self.fleet.wait(workers, 90)

    def _judge_exits(self) -> None:
        self.fleet.reap()
        exercised: Counter[str] = Counter()
        for worker in self.fleet.workers:
            text = worker.log_text()
            exercised.update({k: text.count(v) for k, v in EXERCISED.items() if v in text})
            self.result.workers[worker.name] = {
                "rc": worker.returncode,
                "killed": worker.killed,
                "terminated": worker.terminated,
                "until_end": worker.until_end,
                "batch_size": worker.batch_size,
                "tracebacks": text.count("Traceback"),
            }
            if worker.killed:
                continue
            if worker.returncode != 0:
                tail = " | ".join(text.strip().splitlines()[-3:])
                self.result.problems.append(
                    f"{worker.name} exited {worker.returncode} unexpectedly: {tail[-400:]}"
                )
            elif not worker.terminated and not worker.until_end:
                self.result.problems.append(f"{worker.name} exited 0 on its own, unasked")
        self.result.exercised = dict(exercised)

    # -- the check -------------------------------------------------------------------------

    def _check(self) -> None:
        bootstrap = self.broker.bootstrap
        records = read_topic(bootstrap, self.topic)
        real = {(r.partition, r.offset): r.value for r in records}
        dlq_topic = f"{self.topic}.dlq"
        dlq_records = read_topic(bootstrap, dlq_topic) if topic_exists(bootstrap, dlq_topic) else []
        dlq = dead_letters(dlq_records, self.topic)
        scan = parquet_rows(self.output, self.topic)
        if self.upsert:
            want = upsert.expected(records, self.topic)
            verdict = self._check_documents(want, scan, dlq)
        else:
            rows = scan.rows
            verdict = check_records(real, rows, dlq)
            check_index(verdict, rows, index_entries(self.output, self.topic))
        verdict.other_topics, verdict.bad_vectors = scan.other_topics, scan.bad_vectors
        verdict.unreadable = scan.unreadable
        committed = group_committed(bootstrap, self.group, self.topic, self.partitions)
        check_commits(verdict, committed, end_offsets(bootstrap, self.topic))
        check_java(verdict, real, self.published)
        self._record(verdict)
        self._check_leftovers()
        self.result.audit = run_audit(bootstrap, self.output, self.group, self.topic, verdict.clean)
        if self.chunk_tokens is not None:
            self._check_chunks(real, scan)
        if self.upsert and getattr(self.args, "purge", True):
            self._purge_and_check(want, dlq)

    def _check_chunks(self, real: dict[tuple[int, int], bytes | None], scan: RowScan) -> None:
        """Chunk mode: each record's chunks complete, in one segment, each the record's
        text[char_start:char_end], the windows as asked; `pipeline audit` exits 0 and
        counts the same chunk rows."""
        assert self.chunk_tokens is not None
        model = self.fleet.settings.model
        verdict = check_chunks(
            real,
            scan.rows,
            self.corpus,
            self.chunk_tokens,
            self.chunk_overlap or 0,
            model_length(model),
        )
        r = self.result
        r.chunks = verdict.summary()
        r.chunks["published"] = dict(self.corpus.counts) if self.corpus else {}
        r.problems += verdict.problems()
        audit = r.audit
        if audit.get("present"):
            totals = audit.get("totals") or {}
            r.chunks["audit_chunk_rows"] = totals.get("chunk_rows")
            if audit.get("rc") != 0:
                why = audit.get("error") or audit.get("partitions") or totals
                r.problems.append(f"audit exited {audit.get('rc')} on a chunked output: {why}")
            elif totals.get("chunk_rows") != verdict.rows:
                r.problems.append(
                    f"audit counted {totals.get('chunk_rows')} chunk rows, the check {verdict.rows}"
                )

    def _check_documents(
        self, want: upsert.Expected, scan: RowScan, dlq: Counter[tuple[int, int]]
    ) -> Verdict:
        """Upsert mode: every offset in its place, DIR/current against the topic's live
        documents, the index's shard files and what it serves."""
        verdict, docs = upsert.check_records(want, scan, dlq)
        upsert.check_view(docs, want, upsert.view_rows(self.output), self.topic)
        upsert.check_index(docs, want, scan, upsert.index_ids(self.output, self.topic))
        r = self.result
        r.documents = {
            "live": docs.documents,
            "deletions": docs.deletions,
            "updated": docs.updated,
            "readded": docs.readded,
            "view_rows": docs.view_rows,
            "view_doubled": len(docs.view_doubled),
            "index": docs.index,
            "published": dict(self.docs.counts) if self.docs else {},
        }
        r.view_lost, r.view_extra = len(docs.view_lost), len(docs.view_extra)
        r.view_stale = len(docs.view_stale)
        r.problems += docs.problems()
        return verdict

    def _purge_and_check(self, want: upsert.Expected, dlq: Counter[tuple[int, int]]) -> None:
        """`pipeline compact --purge`, then the check again: the same documents, every
        superseded or deleted row erased (its offset purged), and the audit exits 0."""
        if not self.result.ok:
            self.result.purge = {"skipped": "the check before it failed (evidence kept)"}
            return
        bootstrap = self.broker.bootstrap
        done = upsert.run_purge(bootstrap, self.output)
        problems = [] if done["rc"] == 0 else [f"exited {done['rc']}: {done.get('error')}"]
        scan = parquet_rows(self.output, self.topic)
        verdict, docs = upsert.check_records(want, scan, dlq, purged_phase=True)
        upsert.check_view(docs, want, upsert.view_rows(self.output), self.topic)
        upsert.check_index(docs, want, scan, upsert.index_ids(self.output, self.topic))
        verdict.other_topics, verdict.bad_vectors = scan.other_topics, scan.bad_vectors
        verdict.unreadable = scan.unreadable
        problems += verdict.problems() + docs.problems()
        if done["rc"] == 0 and done.get("live_documents") != len(want.live):
            problems.append(
                f"purge reported {done.get('live_documents')} live documents, "
                f"{len(want.live)} expected"
            )
        audit = run_audit(bootstrap, self.output, self.group, self.topic, verdict.clean)
        if audit.get("present") and audit.get("rc") != 0:
            why = audit.get("error") or audit.get("partitions") or audit.get("totals")
            problems.append(f"audit after the purge exited {audit.get('rc')}: {why}")
        self.result.purge = {
            **{k: v for k, v in done.items() if k != "error"},
            "rows_after": len(scan.rows),
            "purged_offsets": len(scan.purged),
            "index": docs.index,
            "audit_rc": audit.get("rc"),
            "audit_totals": audit.get("totals"),
            "problems": problems,
            "ok": not problems,
        }
        self.result.problems += [f"after purge: {p}" for p in problems]

    def _check_leftovers(self) -> None:
        """Temp files left in DIR/vectors, and what went to DIR/quarantine (informational),
        except a dead host's week-old temp file, which a later start-up must have removed."""
        vectors = self.output / "vectors"
        left = sorted(p.name for p in vectors.glob(f".*{TMP_SUFFIX}")) if vectors.is_dir() else []
        self.result.temp_files_left = len(left)
        self.result.quarantined = len(list((self.output / "quarantine").glob("*.json")))
        planted = [name for name in left if ".gone-host." in name]
        if planted:
            self.result.problems.append(f"stale temp files of a dead host not removed: {planted}")

    def _record(self, verdict: Verdict) -> None:
        r = self.result
        r.records, r.bad_records, r.rows = verdict.records, verdict.bad_records, verdict.rows
        r.java_aborted = len(self.published.java_aborted_ids)
        r.lost, r.doubled, r.phantom = len(verdict.lost), len(verdict.doubled), len(verdict.phantom)
        r.misrouted, r.mismatched = len(verdict.misrouted), len(verdict.mismatched)
        r.dead_letter_repeats = verdict.dead_letter_repeats
        r.index = verdict.index
        r.problems = verdict.problems() + r.problems

    def _save(self) -> None:
        (self.dir / "result.json").write_text(json.dumps(asdict(self.result), indent=1))

    def clean_up(self) -> None:
        """Deletes the seed's topics (a passing seed's files stay for inspection)."""
        from kafka import KafkaAdminClient

        with contextlib.suppress(Exception):
            admin = KafkaAdminClient(bootstrap_servers=self.broker.bootstrap)
            try:
                existing = set(admin.list_topics())
                doomed = [t for t in (self.topic, f"{self.topic}.dlq") if t in existing]
                if doomed:
                    admin.delete_topics(doomed)
            finally:
                admin.close()


# ---------------------------------------------------------------------------- main
