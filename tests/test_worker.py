"""The worker against the real broker: every record exactly once in the outputs,
through bad records, crashes, rebalances and slow batches."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.structs import OffsetAndMetadata

from pipeline.model import openvino_engine
from tests.helpers import (
    committed_offsets,
    corpus_records,
    duplicates,
    index_rows,
    output_rows,
    publish_json,
    publish_raw,
    read_topic,
    run_until_end,
    start_worker,
    stop,
    worker_args,
    worker_env,
)

pytestmark = pytest.mark.integration


def _partition_counts(bootstrap: str, topic: str) -> dict[int, int]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or []]
    ends = consumer.end_offsets(parts)
    consumer.close()
    return {tp.partition: end for tp, end in ends.items()}


def _assert_exactly_once(broker: str, topic: str, output: Path, dead: set[tuple] = frozenset()):
    rows = output_rows(output)
    assert duplicates(rows) == []
    expected = {
        (topic, p, o) for p, n in _partition_counts(broker, topic).items() for o in range(n)
    }
    assert set(rows) == expected - set(dead)
    assert sorted(index_rows(output)) == sorted(rows)


def test_until_end_embeds_every_record_once_and_commits(broker, make_topic, group_id, tmp_path):
    topic = make_topic(partitions=3)
    records = corpus_records(300)
    publish_json(broker, topic, records, partitions=3)
    out = tmp_path / "out"

    result = run_until_end(broker, topic, group_id, out, "--batch-size", "64")

    assert result.returncode == 0, result.stderr
    _assert_exactly_once(broker, topic, out)
    assert committed_offsets(broker, group_id, topic) == {0: 100, 1: 100, 2: 100}
    # The rows carry the record and metadata the contract promises.
    tables = [pq.read_table(p) for p in sorted((out / "vectors").glob("*.parquet"))]
    by_id = {r["id"]: r for t in tables for r in t.to_pylist()}
    assert by_id["doc-0"]["text"] == records[0]["text"]
    assert json.loads(by_id["doc-0"]["metadata"]) == {"lang": "en"}
    assert len(by_id["doc-0"]["embedding"]) == 384
    meta = pq.read_schema(next((out / "vectors").glob("*.parquet"))).metadata
    assert meta[b"embedding.precision"] == b"fp32"
    assert meta[b"embedding.dim"] == b"384"


def _wait_for_commits(broker: str, group: str, topic: str, total: int, timeout_s: float) -> float:
    """Seconds until the group's commits on the topic sum to total."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if sum(v or 0 for v in committed_offsets(broker, group, topic).values()) == total:
            return time.monotonic() - started
        time.sleep(0.2)
    pytest.fail(f"commits did not reach {total} within {timeout_s:.0f}s")


def test_a_trickle_is_committed_without_waiting_for_a_full_batch_or_the_poll_timeout(
    broker, make_topic, group_id, tmp_path
):
    topic = make_topic(partitions=2)
    out = tmp_path / "out"
    log = tmp_path / "worker.log"
    # Neither a full batch nor the poll timeout can close these batches: only
    # catching up with the partitions can.
    slow_close = ("--batch-size", "4096", "--poll-timeout-ms", "600000")
    worker = start_worker(broker, topic, group_id, out, *slow_close, log=log)
    try:
        publish_json(broker, topic, corpus_records(6), partitions=2)
        _wait_for_commits(broker, group_id, topic, 6, timeout_s=120)  # includes model load
        publish_json(broker, topic, corpus_records(4, seed=1), partitions=2)
        steady = _wait_for_commits(broker, group_id, topic, 10, timeout_s=60)
    finally:
        assert stop(worker) == 0, log.read_text()[-3000:]
    assert steady < 30, f"a warm worker took {steady:.1f}s to commit 4 records"
    _assert_exactly_once(broker, topic, out)


BAD_VALUES: list[tuple[str, bytes | None]] = [
    ("InvalidUtf8", b"\xff\xfe not utf-8"),
    ("InvalidJson", b'{"text": "unterminated'),
    ("NotAnObject", b'["a", "list"]'),
    ("MissingText", b'{"id": "x"}'),
    ("TextNotString", b'{"text": 42}'),
    ("EmptyText", b'{"text": ""}'),
    ("EmptyText", b'{"text": "   \\n\\t "}'),
    ("Tombstone", None),
    ("TextTooLarge", json.dumps({"text": "x" * 5000}).encode()),
    # Past json's recursion limit, read (by orjson) or written back: it had stopped the worker.
    ("NestedTooDeep", b"[" * 3000 + b"]" * 3000),
    ("NestedTooDeep", b'{"text": "ok", "tags": ' + b"[" * 1010 + b"]" * 1010 + b"}"),
    ("NumberOutOfRange", b'{"text": "ok", "n": ' + b"1" * 5000 + b"}"),  # and this
]


def test_bad_records_go_to_the_dead_letter_topic_once_with_headers(
    broker, make_topic, group_id, tmp_path
):
    topic = make_topic(partitions=2)
    items: list[tuple[bytes | None, bytes | None]] = []
    expected_bad = {}
    good = corpus_records(40)
    for i, record in enumerate(good):
        items.append((f"good-{i}".encode(), json.dumps(record).encode()))
        if i < len(BAD_VALUES):
            kind, value = BAD_VALUES[i]
            key = f"bad-{i}".encode()
            items.append((key, value))
            expected_bad[key] = (kind, value)
    publish_raw(broker, topic, items, partitions=2)
    out = tmp_path / "out"

    result = run_until_end(
        broker, topic, group_id, out, "--batch-size", "8", "--max-text-bytes", "4096"
    )

    assert result.returncode == 0, result.stderr
    dead = read_topic(broker, f"{topic}.dlq")
    assert sorted(r.key for r in dead) == sorted(expected_bad)
    dead_positions = set()
    for record in dead:
        kind, value = expected_bad[record.key]
        headers = {k: v.decode() for k, v in record.headers}
        assert record.value == value  # unchanged bytes
        assert headers["error.class"] == kind
        assert headers["error.stage"] in ("decode", "validate")
        assert headers["error.message"]
        assert headers["source.topic"] == topic
        position = (topic, int(headers["source.partition"]), int(headers["source.offset"]))
        dead_positions.add(position)
    _assert_exactly_once(broker, topic, out, dead=dead_positions)
    assert len(output_rows(out)) == len(good)


def test_crash_between_publish_and_commit_leaves_no_duplicate(
    broker, make_topic, group_id, tmp_path
):
    """The output directory is the truth: files past the committed offset are skipped."""
    topic = make_topic(partitions=2)
    publish_json(broker, topic, corpus_records(120), partitions=2)
    out = tmp_path / "out"
    assert run_until_end(broker, topic, group_id, out, "--batch-size", "32").returncode == 0
    rows_before = sorted(output_rows(out))
    # Rewind the group as if the commits after the last renames had never happened.
    consumer = KafkaConsumer(bootstrap_servers=broker, group_id=group_id, enable_auto_commit=False)
    consumer.assign([TopicPartition(topic, 0), TopicPartition(topic, 1)])
    consumer.commit({TopicPartition(topic, p): OffsetAndMetadata(10, "", -1) for p in (0, 1)})
    consumer.close(autocommit=False)

    result = run_until_end(broker, topic, group_id, out, "--batch-size", "32")

    assert result.returncode == 0, result.stderr
    assert sorted(output_rows(out)) == rows_before
    assert committed_offsets(broker, group_id, topic) == {0: 60, 1: 60}
    _assert_exactly_once(broker, topic, out)


@pytest.mark.slow
def test_kill_9_at_random_moments_then_restart_loses_and_duplicates_nothing(
    broker, make_topic, group_id, tmp_path
):
    topic = make_topic(partitions=3)
    publish_json(broker, topic, corpus_records(900), partitions=3)
    out = tmp_path / "out"
    log = tmp_path / "worker.log"
    rng = random.Random(7)
    kills = 0
    for _ in range(6):
        proc = start_worker(
            broker,
            topic,
            group_id,
            out,
            "--batch-size",
            "24",
            "--poll-timeout-ms",
            "100",
            "--index-sync-interval-s",
            "1",
            "--session-timeout-ms",
            "6000",
            log=log,
        )
        time.sleep(rng.uniform(5.0, 9.0))  # start-up takes ~4 s; then kill mid-stream
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait(timeout=30)
        assert duplicates(output_rows(out)) == []
    assert kills >= 5

    result = run_until_end(
        broker,
        topic,
        group_id,
        out,
        "--batch-size",
        "64",
        "--session-timeout-ms",
        "6000",
        timeout=600,
    )

    assert result.returncode == 0, result.stderr
    _assert_exactly_once(broker, topic, out)
    assert not list((out / "vectors").glob(".*.tmp"))
    print(
        f"kill -9 loop: {kills} kills, 900 rows expected, {len(output_rows(out))} found, "
        f"{len(duplicates(output_rows(out)))} duplicates, {len(index_rows(out))} index entries"
    )


@pytest.mark.slow
def _engine_processes(pid: int) -> list[int]:
    """The OpenVINO replica processes among a worker's children."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"pipeline.model.engine_process" in cmdline:
                found.append(int(child))
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not openvino_engine.available(), reason="no OpenVINO")
def test_an_int8_worker_killed_mid_stream_leaves_no_engine_process_and_restarts_exactly_once(
    broker, make_topic, group_id, tmp_path
):
    """int8 runs a process per replica: a worker SIGKILLed mid-stream takes them with
    it, and its restart lands every record once."""
    topic = make_topic(partitions=3)
    publish_json(broker, topic, corpus_records(600), partitions=3)
    out = tmp_path / "out"
    int8 = ["--precision", "int8", "--replicas", "2", "--torch-threads", "1"]
    short = ["--session-timeout-ms", "6000", "--index-sync-interval-s", "1"]
    proc = start_worker(
        broker, topic, group_id, out, *int8, *short, "--batch-size", "32",
        "--poll-timeout-ms", "100", log=tmp_path / "worker.log",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not output_rows(out) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        engines = _engine_processes(proc.pid)
        assert output_rows(out) and len(engines) == 2, (tmp_path / "worker.log").read_text()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while any(map(_running, engines)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in engines if _running(pid)]

    result = run_until_end(broker, topic, group_id, out, *int8, *short, timeout=600)

    assert result.returncode == 0, result.stderr
    _assert_exactly_once(broker, topic, out)
    assert "engine processes" in result.stderr  # their CPU, in the done: line's account
    meta = pq.read_schema(next((out / "vectors").glob("*.parquet"))).metadata
    assert meta[b"embedding.precision"] == b"int8"


def test_workers_joining_and_leaving_mid_run(broker, make_topic, group_id, tmp_path):
    topic = make_topic(partitions=4)
    publish_json(broker, topic, corpus_records(1200), partitions=4)
    out = tmp_path / "out"
    common = ("--batch-size", "32", "--poll-timeout-ms", "100", "--session-timeout-ms", "6000")
    first = start_worker(broker, topic, group_id, out, *common, log=tmp_path / "a.log")
    time.sleep(6)
    second = start_worker(broker, topic, group_id, out, *common, log=tmp_path / "b.log")
    time.sleep(8)
    assert stop(first) == 0  # leaves mid-run: SIGTERM, finishes or drops its batch, exit 0
    third = start_worker(broker, topic, group_id, out, *common, log=tmp_path / "c.log")
    time.sleep(8)
    assert stop(second) == 0
    assert stop(third) == 0
    assert duplicates(output_rows(out)) == []

    result = run_until_end(broker, topic, group_id, out, *common, timeout=600)

    assert result.returncode == 0, result.stderr
    _assert_exactly_once(broker, topic, out)


@pytest.mark.slow
def test_batch_slower_than_max_poll_interval_keeps_the_worker_in_its_group(
    broker, make_topic, group_id, tmp_path
):
    topic = make_topic(partitions=1)
    # Long texts (truncated at 256 tokens) in batches of 256 at fp32: each batch takes
    # several seconds on a CPU, well over the 2 s max.poll.interval set below.
    paragraphs = [r["text"] for r in corpus_records(768 * 8)]
    long_records = [
        {"id": str(i), "text": " ".join(paragraphs[8 * i : 8 * i + 8])} for i in range(768)
    ]
    publish_json(broker, topic, long_records)
    out = tmp_path / "out"

    started = time.monotonic()
    result = run_until_end(
        broker,
        topic,
        group_id,
        out,
        "--batch-size",
        "256",
        "--max-in-flight",
        "1",
        "--max-batch-tokens",
        "1000000",
        "--max-poll-interval-ms",
        "2000",
        "--session-timeout-ms",
        "6000",
    )
    elapsed = time.monotonic() - started

    assert result.returncode == 0, result.stderr
    _assert_exactly_once(broker, topic, out)
    # One assignment at start and one revocation at close: no eviction, no rebalance.
    assert result.stderr.count("partitions joined the group") == 1, result.stderr
    assert "partitions rebalanced" not in result.stderr
    assert "partitions lost" not in result.stderr
    assert result.stderr.count("partitions revoked at close: ") == 1
    assert elapsed > 6  # the batches really were slower than max.poll.interval


def _peak_rss_mb(broker: str, topic: str, group: str, output: Path, *extra: str) -> float:
    """Peak RSS of one `pipeline run --until-end`, measured by a wrapper process."""
    code = (
        "import resource, subprocess, sys, json\n"
        "args = json.loads(sys.argv[1])\n"
        "rc = subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)"
        ".returncode\n"
        "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    args = [*worker_args(topic, group, output, *extra), "--until-end"]
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)],
        env=worker_env(broker),
        capture_output=True,
        text=True,
        timeout=600,
    )
    rc, kb = done.stdout.split()
    assert rc == "0", done.stderr
    return int(kb) / 1024


def _big_records(count: int, size: int) -> Iterator[dict[str, str]]:
    """`count` distinct records of about `size` bytes: a short text, and the rest in a
    field the worker keeps as the row's metadata (letters only, quick to parse)."""
    letters = str.maketrans("0123456789", "ghijklmnop")
    for i in range(count):
        blob = os.urandom(size // 2).hex().translate(letters)
        words = " ".join(blob[j : j + 8] for j in range(0, 400, 8))
        yield {"id": f"big-{i}", "text": f"record {i}: {words}", "blob": blob[400:]}


@pytest.mark.slow
def test_memory_stays_flat_with_a_backlog_far_larger_than_the_working_set(
    broker, make_topic, tmp_path, tiny_model
):
    """Peak RSS is bounded by the worker's working set, not by what waits in Kafka.

    The working set: the consumer's fetch buffers (16 MiB a fetch, 2 MiB a
    partition) and at most --max-in-flight batches of --max-batch-bytes (1 MiB
    here) besides the open one and the queued one. The large backlog holds 240 MB
    of record values, several times all of that; a worker that held what it
    polled, batches it had committed, or a fetch it did not bound would grow by a
    good share of it. The tiny model keeps this to the worker's own memory (and
    quick): what a real model's passes hold under a backlog is bounded by the
    pass budget (pipeline.model.shapes) and measured by scripts/memory.py.
    """
    record_bytes = 60_000
    flags = ["--model", tiny_model, "--max-batch-bytes", str(1 << 20), "--max-in-flight", "2"]
    peaks: dict[int, float] = {}
    for count in (16, 4000):  # ~1 MB (one batch) and ~240 MB of values
        topic = make_topic(partitions=2)
        publish_json(broker, topic, _big_records(count, record_bytes), partitions=2)
        output = tmp_path / topic
        peaks[count] = _peak_rss_mb(broker, topic, f"mem-{topic}", output, *flags)
        rows = sum(pq.read_metadata(f).num_rows for f in (output / "vectors").glob("*.parquet"))
        assert rows == count
    backlog_mb = 4000 * record_bytes / 1e6
    growth = peaks[4000] - peaks[16]
    print(
        f"peak RSS: {peaks[16]:.0f} MB with a one-batch backlog, {peaks[4000]:.0f} MB with "
        f"{backlog_mb:.0f} MB of backlog (+{growth:.0f} MB)"
    )
    # Filling the working set (fetch buffers, batches in flight) took +32 MB here;
    # holding even a fourth of the backlog would take more than twice that.
    assert growth <= backlog_mb / 4
