"""Priority tiers on the real broker (`pipeline run --topic LIVE --backfill-topic CORPUS`):
nearline records stay fast while a large backfill waits, the backfill finishes once
nearline is idle, pauses hold through members joining and leaving, and every offset
of both topics lands exactly once in the outputs (read back from the Parquet files,
the index, the group's commits and `pipeline audit`, not from the workers' word).

Workers embed with the `slow` random model (scripts/tiny_model.py --slow), so that a
backfill takes tens of seconds on a CPU and batches are in flight through rebalances.
What the workers did is read from their Prometheus metrics, sampled every 0.2 s:
`pipeline_backfill_waiting`, `pipeline_backfill_pauses_total`,
`pipeline_tier_records_total{tier}` (records polled into batches) and
`pipeline_tier_partitions{tier,state}` (from the consumer's own paused set).
"""

from __future__ import annotations

import itertools
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from consumers.tiers import LASTING_WAIT_S
from tests.helpers import (
    PIPELINE,
    REPO,
    committed_offsets,
    corpus_records,
    duplicates,
    index_rows,
    output_rows,
    publish_json,
    publish_raw,
    read_topic,
    start_worker,
    stop,
    worker_env,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FAST_GROUP = ("--session-timeout-ms", "6000", "--poll-timeout-ms", "100")
WAITING = "pipeline_backfill_waiting"
PAUSES = "pipeline_backfill_pauses_total"
BACKFILL_RECORDS = 'pipeline_tier_records_total{tier="backfill"}'
NEARLINE_RECORDS = 'pipeline_tier_records_total{tier="nearline"}'
BACKFILL_READING = 'pipeline_tier_partitions{state="reading",tier="backfill"}'
BACKFILL_PAUSED = 'pipeline_tier_partitions{state="paused",tier="backfill"}'
REBALANCES = "pipeline_rebalance_events_total"


@pytest.fixture(scope="module")
def slow_model() -> str:
    built = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "tiny_model.py"), "--slow"],
        capture_output=True,
        text=True,
        check=True,
    )
    return built.stdout.strip().splitlines()[-1]


# -- watching the outputs and the workers -------------------------------------------------


class Poller:
    """Calls `tick()` every `period` seconds on a thread, inside a with-block."""

    period = 0.2

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Any:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.tick()

    def tick(self) -> None:
        raise NotImplementedError


class Visibility(Poller):
    """When each record id first appears in a published Parquet segment."""

    period = 0.05

    def __init__(self, output: Path) -> None:
        super().__init__()
        self.vectors = output / "vectors"
        self.seen_at: dict[str, float] = {}
        self._files: set[str] = set()
        self._lock = threading.Lock()

    def tick(self) -> None:
        if not self.vectors.is_dir():
            return
        for path in sorted(self.vectors.glob("*.parquet")):
            if path.name in self._files:
                continue
            now = time.time()
            try:
                ids = pq.read_table(path, columns=["id"]).column("id").to_pylist()
            except (FileNotFoundError, OSError):
                continue  # merged away by compaction meanwhile: its rows are in the new file
            self._files.add(path.name)
            with self._lock:
                for record_id in ids:
                    self.seen_at.setdefault(record_id, now)

    def count(self, prefix: str) -> int:
        with self._lock:
            return sum(1 for i in self.seen_at if i.startswith(prefix))

    def times(self) -> dict[str, float]:
        with self._lock:
            return dict(self.seen_at)


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


class Metrics(Poller):
    """A worker's metrics every 0.2 s, as (time, values) samples."""

    def __init__(self, port: int) -> None:
        super().__init__()
        self.port = port
        self.samples: list[tuple[float, dict[str, float]]] = []

    def tick(self) -> None:
        try:
            values = scrape(self.port)
        except OSError:
            return  # not serving yet, or gone
        if WAITING in values:
            values[REBALANCES] = sum(v for k, v in values.items() if k.startswith(REBALANCES))
            self.samples.append((time.time(), values))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(
    condition: Callable[[], bool], timeout: float, what: str, workers: Sequence[Any], log: Path
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if any(w.poll() is not None for w in workers):
            raise AssertionError(f"a worker exited while waiting for {what}\n{tail(log)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{tail(log)}")
        time.sleep(0.1)


def tail(*logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in logs if p.exists())


def produce(
    bootstrap: str,
    topic: str,
    texts: Sequence[str],
    rate: float | None,
    partitions: int,
    prefix: str,
) -> dict[str, float]:
    """Sends {"id": prefix-n, "text": ...} records, at `rate` records/s (None: at once);
    returns when each id was sent."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=0, acks=1)
    sent: dict[str, float] = {}
    began = time.monotonic()
    for n, text in enumerate(texts):
        if rate is not None:
            delay = began + n / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        record_id = f"{prefix}{n}"
        sent[record_id] = time.time()
        value = json.dumps({"id": record_id, "text": text}).encode()
        producer.send(topic, value, partition=n % partitions)
    producer.flush(60)
    producer.close(10)
    return sent


def longest_wait(samples: list[tuple[float, dict[str, float]]]) -> float:
    """Seconds of the longest single wait the samples saw (waiting, same pause count)."""
    spans: dict[float, list[float]] = {}
    for when, values in samples:
        if values[WAITING] == 1:
            spans.setdefault(values[PAUSES], []).append(when)
    return max((max(times) - min(times) for times in spans.values()), default=0.0)


def waited_pairs(samples: list[tuple[float, dict[str, float]]]) -> list[tuple[dict, dict]]:
    """Consecutive samples between which the worker waited all along: waiting in both,
    no new pause in between (resuming takes a second at zero lag; samples are 0.2 s
    apart, and a pause in between would count)."""
    return [
        (a, b)
        for (_, a), (_, b) in itertools.pairwise(samples)
        if a[WAITING] == 1 and b[WAITING] == 1 and a[PAUSES] == b[PAUSES]
    ]


def assert_no_backfill_read_while_waiting(samples: list[tuple[float, dict[str, float]]]) -> None:
    for a, b in waited_pairs(samples):
        assert b[BACKFILL_RECORDS] == a[BACKFILL_RECORDS], "backfill records polled while waiting"
        assert b[BACKFILL_READING] == 0, "a backfill partition not paused while waiting"


# -- the independent check ------------------------------------------------------------------


def partition_ends(bootstrap: str, topic: str) -> dict[int, int]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or []]
    ends = consumer.end_offsets(parts)
    consumer.close()
    return {tp.partition: end for tp, end in ends.items()}


def assert_every_offset_of_every_topic_once(
    bootstrap: str, topics: Sequence[str], group: str, output: Path
) -> None:
    """Rows and dead letters (in the first nearline topic's .dlq, as the worker sends
    them, backfill ones too) together hold every offset of the topics, once."""
    rows = output_rows(output)
    assert duplicates(rows) == [], "doubled rows"
    dead = [
        (h["source.topic"], int(h["source.partition"]), int(h["source.offset"]))
        for h in (
            {k: v.decode() for k, v in record.headers}
            for record in read_topic(bootstrap, f"{topics[0]}.dlq")
        )
    ]
    assert duplicates(dead) == [] and not set(dead) & set(rows), "doubled dead letters"
    expected = set()
    for topic in topics:
        ends = partition_ends(bootstrap, topic)
        expected |= {(topic, p, o) for p, end in ends.items() for o in range(end)}
        assert committed_offsets(bootstrap, group, topic) == ends, f"commits of {topic}"
    missing = expected - set(rows) - set(dead)
    assert not missing, f"{len(missing)} offsets lost, e.g. {sorted(missing)[:5]}"
    assert set(rows) | set(dead) == expected
    assert sorted(index_rows(output)) == sorted(rows)
    audit = subprocess.run(
        [*PIPELINE, "audit", "--output", str(output), "--group", group, "--json"],
        env=worker_env(bootstrap),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-3000:]


def status_report(bootstrap: str, group: str) -> dict[str, Any]:
    result = subprocess.run(
        [*PIPELINE, "status", "--group", group, "--json"],
        env=worker_env(bootstrap),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode in (0, 1, 2, 3), result.stderr
    return json.loads(result.stdout)


def tiers_of(report: dict[str, Any]) -> dict[str, set[Any]]:
    tiers: dict[str, set[Any]] = {}
    for row in report["partitions"]:
        tiers.setdefault(row["topic"], set()).add(row["tier"])
    return tiers


# -- the tests -------------------------------------------------------------------------------


def test_nearline_first_while_a_large_backfill_waits(
    broker, make_topic, group_id, tmp_path, slow_model
):
    """(a) A backfill of 8,000 records is under way. A nearline burst (more than the
    worker takes in at once: fetch lag) makes the backfill wait, and drains with no backfill record
    polled meanwhile; then nearline records at a steady 10/s are visible within
    seconds while the backfill still has thousands to go; the backfill finishes once
    nearline is idle. (c) Every offset of both topics once."""
    live, corpus = make_topic(2, prefix="live"), make_topic(2, prefix="corpus")
    backfill = 8_000
    publish_json(broker, corpus, corpus_records(backfill), partitions=2)  # ids doc-N
    bad = [(None, b"{not json"), (None, b'{"text": "  "}'), (b"k", None)]  # dead letters
    publish_raw(broker, corpus, bad, partitions=2)
    out, log, port = tmp_path / "out", tmp_path / "worker.log", free_port()
    worker = start_worker(
        broker,
        live,
        group_id,
        out,
        "--backfill-topic",
        corpus,
        "--model",
        slow_model,
        "--batch-size",
        "256",
        "--metrics-port",
        str(port),
        "--cache",
        "off",  # nearline texts come from the same corpus: every one must be embedded
        *FAST_GROUP,
        log=log,
    )
    texts = [r["text"] for r in corpus_records(2200, seed=7)]
    try:
        with Visibility(out) as seen, Metrics(port) as metrics:
            wait_until(lambda: seen.count("doc-") > 0, 300, "backfill to start", [worker], log)
            # Enough backfill for a minute at this machine's pace (shared CPUs vary 10x).
            began, done = time.monotonic(), seen.count("doc-")
            time.sleep(3)
            rate = (seen.count("doc-") - done) / (time.monotonic() - began)
            extra = int(rate * 60) - (backfill - seen.count("doc-"))
            if extra > 0:
                more = corpus_records(extra, seed=5)
                for n, r in enumerate(more):
                    r["id"] = f"doc-{backfill + n}"
                publish_json(broker, corpus, more, partitions=2)
                backfill += extra
            # More than the worker takes in (--max-in-flight + 1 batches): fetch lag.
            burst = produce(broker, live, texts[:2000], None, 2, "burst-")
            publish_raw(broker, live, bad[:2], partitions=2)
            wait_until(lambda: seen.count("burst-") == len(burst), 300, "the burst", [worker], log)
            burst_done = len(metrics.samples)
            steady = produce(broker, live, texts[2000:2150], 10.0, 2, "live-")
            backfill_left = backfill - seen.count("doc-")
            wait_until(
                lambda: seen.count("live-") == len(steady), 300, "steady records", [worker], log
            )
            wait_until(lambda: seen.count("doc-") == backfill, 600, "the backfill", [worker], log)
            wait_until(
                lambda: metrics.samples[-1][1][WAITING] == 0, 60, "backfill resumed", [worker], log
            )
            visible = seen.times()
        assert stop(worker) == 0, tail(log)
    finally:
        stop(worker)

    latencies = sorted(visible[i] - t for i, t in steady.items())
    p50, p90 = statistics.median(latencies), latencies[int(0.9 * len(latencies))]
    drain = max(visible[i] for i in burst) - min(burst.values())
    print(
        f"burst of {len(burst)} drained in {drain:.1f}s; steady nearline produce-to-visible: "
        f"p50 {p50:.2f}s p90 {p90:.2f}s with {backfill_left} backfill records to go"
    )
    samples = metrics.samples
    # The burst made backfill wait; nearline records went through meanwhile, no backfill
    # record was polled, and no backfill partition was read.
    assert any(s[WAITING] == 1 for _, s in samples[:burst_done]), "backfill never waited"
    assert any(b[NEARLINE_RECORDS] > a[NEARLINE_RECORDS] for a, b in waited_pairs(samples))
    assert_no_backfill_read_while_waiting(samples)
    # Steady nearline records stayed fast with thousands of backfill records to go.
    assert backfill_left > 1000, "the backfill ended before nearline did: nothing was measured"
    assert p90 < 10.0, f"nearline p90 {p90:.1f}s with a backfill of {backfill_left} waiting"
    # The backfill resumed and finished, each record polled once.
    assert samples[-1][1][WAITING] == 0 and samples[-1][1][PAUSES] >= 1
    assert samples[-1][1][BACKFILL_RECORDS] == backfill + len(bad)
    text = log.read_text()
    if longest_wait(samples) > LASTING_WAIT_S + 1:  # shorter ones log at DEBUG only
        assert "backfill waits: nearline lag" in text and "backfill resumes" in text
    assert_every_offset_of_every_topic_once(broker, [live, corpus], group_id, out)
    report = status_report(broker, group_id)
    assert tiers_of(report) == {live: {"nearline"}, corpus: {"backfill"}}
    # The worker's dead-letter topic, found from the tiers: its nearline topic's .dlq.
    assert report["dead_letter"] == {"topic": f"{live}.dlq", "records": 5}


def test_pauses_hold_through_a_member_joining_and_leaving(
    broker, make_topic, group_id, tmp_path, slow_model
):
    """(b) While a nearline backlog lasts, a second worker joins and leaves: after each
    rebalance every worker that waits holds its backfill partitions, the new ones too,
    paused (from the consumer's own paused set), and polls no backfill record.
    (c) Every offset of both topics once."""
    # Named so that nearline sorts first: the sticky assignor then tends to hand the
    # joining member backfill partitions, which the first worker gets back while it
    # still waits (either way, the checks below hold).
    live, corpus = make_topic(4, prefix="a-live"), make_topic(4, prefix="b-corpus")
    backfill = 3_000
    publish_json(broker, corpus, corpus_records(backfill), partitions=4)
    out = tmp_path / "out"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    ports = [free_port(), free_port()]
    options = (
        "--backfill-topic",
        corpus,
        "--model",
        slow_model,
        "--batch-size",
        "128",
        "--cache",
        "off",
    )

    def worker(n: int) -> subprocess.Popen[bytes]:
        extra = (*options, "--metrics-port", str(ports[n]), *FAST_GROUP)
        return start_worker(broker, live, group_id, out, *extra, log=logs[n])

    # Long nearline texts: a backlog of them keeps nearline lag up through the rebalances
    # (4,000: with 2,400 the backlog ran out about when the second worker left).
    paragraphs = [r["text"] for r in corpus_records(24_000, seed=3)]
    long_texts = [" ".join(paragraphs[i : i + 6]) for i in range(0, 24_000, 6)]
    first = worker(0)
    second = None
    try:
        with Visibility(out) as seen, Metrics(ports[0]) as a, Metrics(ports[1]) as b:
            wait_until(lambda: seen.count("doc-") > 0, 300, "backfill to start", [first], logs[0])
            produce(broker, live, long_texts, None, 4, "live-")
            wait_until(
                lambda: bool(a.samples) and a.samples[-1][1][WAITING] == 1,
                120,
                "backfill to wait",
                [first],
                logs[0],
            )
            joined_at = len(a.samples)
            second = worker(1)
            wait_until(
                lambda: bool(b.samples) and b.samples[-1][1][REBALANCES] >= 1,
                180,
                "the second worker to take partitions",
                [first, second],
                logs[1],
            )
            time.sleep(6)
            assert stop(second) == 0, tail(logs[1])
            left_at = len(a.samples)
            wait_until(
                lambda: seen.count("live-") == len(long_texts) and seen.count("doc-") == backfill,
                900,
                "every record",
                [first],
                logs[0],
            )
            wait_until(
                lambda: a.samples[-1][1][WAITING] == 0, 60, "backfill to resume", [first], logs[0]
            )
        assert stop(first) == 0, tail(logs[0])
    finally:
        for proc in (first, second):
            if proc is not None:
                stop(proc)

    # The pauses held on whatever each rebalance assigned, on both workers.
    for samples in (a.samples, b.samples):
        assert_no_backfill_read_while_waiting(samples)
    # The first worker waited across both rebalances (the nearline backlog outlasted
    # them): its backfill partitions, kept or handed back, stayed paused.
    across = [
        (x, y) for x, y in waited_pairs(a.samples[joined_at:]) if y[REBALANCES] > x[REBALANCES]
    ]
    assert across, "no rebalance of the first worker while it waited"
    after_leave = [s for _, s in a.samples[left_at:] if s[WAITING] == 1]
    assert any(s[BACKFILL_PAUSED] == 4 for s in after_leave), (
        "after the second worker left, the first did not hold all 4 backfill partitions paused"
    )
    assert a.samples[-1][1][WAITING] == 0  # backfill resumed, and finished
    assert_every_offset_of_every_topic_once(broker, [live, corpus], group_id, out)
    assert tiers_of(status_report(broker, group_id)) == {live: {"nearline"}, corpus: {"backfill"}}
