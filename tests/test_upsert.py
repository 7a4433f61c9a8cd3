"""Upsert mode against the real broker: documents by key, updated, deleted and added
again; the current view read with Lance's own package, Polars and DuckDB; search
over live documents only; every offset once through a SIGKILL, checked against the
topic itself."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import lance
import pyarrow.parquet as pq
import pytest

from tests.helpers import (
    PIPELINE,
    REPO,
    duplicates,
    output_rows,
    publish_raw,
    read_topic,
    run_until_end,
    start_worker,
    stop,
    worker_env,
)

pytestmark = pytest.mark.integration


def value(text: str, **fields: object) -> bytes:
    return json.dumps({"text": text, **fields}).encode()


def view_rows(output: Path) -> dict[str, dict]:
    rows = lance.dataset(str(output / "current")).to_table().to_pylist()
    assert len(rows) == len({r["doc_key"] for r in rows}), "one row per live document"
    return {r["doc_key"]: r for r in rows}


def expected_live(bootstrap: str, topic: str) -> dict[str, str]:
    """The live documents as the topic itself says: each key's record with the highest
    offset (producers here key by document, so one key stays in one partition)."""
    latest: dict[bytes, tuple[int, bytes | None]] = {}
    for record in read_topic(bootstrap, topic):
        held = latest.get(record.key)
        if held is None or record.offset > held[0]:
            latest[record.key] = (record.offset, record.value)
    return {k.decode(): json.loads(v)["text"] for k, (_, v) in latest.items() if v is not None}


def search(output: Path, query: str, bootstrap: str) -> list[dict]:
    done = subprocess.run(
        [*PIPELINE, "search", "--output", str(output), "--json", "-k", "5", query],
        env=worker_env(bootstrap), cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["hits"]


def test_the_issue_corpus_ends_as_the_corpus_is_now(
    broker: str, make_topic, group_id: str, tmp_path: Path
) -> None:
    topic = make_topic(partitions=1)
    publish_raw(
        broker,
        topic,
        [
            (b"doc1", value("The cafeteria serves pasta on Mondays.")),
            (b"doc2", value("Employee salary records are stored in room 12.")),
            (b"doc1", value("The cafeteria now serves curry on Mondays.")),
            (b"doc2", None),
            (b"doc3", value("The library opens at nine.")),
            (b"", None),  # a tombstone naming nothing: a dead letter
        ],
    )
    output = tmp_path / "out"
    done = run_until_end(broker, topic, group_id, output, "--write-mode", "upsert")
    assert done.returncode == 0, done.stderr
    live = view_rows(output)
    assert {k: r["text"] for k, r in live.items()} == {
        "doc1": "The cafeteria now serves curry on Mondays.",
        "doc3": "The library opens at nine.",
    }
    hits = search(output, "salary records room", broker)
    assert all(h["doc_key"] != "doc2" and "salary" not in h["text"] for h in hits)
    hits = search(output, "what does the cafeteria serve on Monday", broker)
    assert hits[0]["text"] == "The cafeteria now serves curry on Mondays."
    assert all("pasta" not in h["text"] for h in hits)
    # History keeps every offset once, the tombstone's included; the dead letter names why.
    assert sorted(o for _, _, o in output_rows(output)) == [0, 1, 2, 3, 4]
    dead = read_topic(broker, f"{topic}.dlq")
    assert [dict(d.headers)["error.class"] for d in dead] == [b"MissingDocumentKey"]
    checks = (["audit", "--group", group_id, "--topic", topic], ["index", "check"])
    for command in checks:
        assert pipeline(broker, *command, "--output", str(output)).returncode == 0
    # Erasure: the deleted and superseded texts leave every file; the offsets stay accounted.
    purged = pipeline(broker, "compact", "--purge", "--json", "--output", str(output))
    assert json.loads(purged.stdout)["erased_rows"] == 3
    raw = b"".join(p.read_bytes() for p in output.rglob("*") if p.is_file())
    for erased in (b"salary records", b"serves pasta"):
        assert erased not in raw
    for command in checks:
        assert pipeline(broker, *command, "--output", str(output)).returncode == 0
    assert {k: r["text"] for k, r in view_rows(output).items()} == {
        "doc1": "The cafeteria now serves curry on Mondays.",
        "doc3": "The library opens at nine.",
    }


def pipeline(broker: str, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [*PIPELINE, *args], env=worker_env(broker), cwd=REPO, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"pipeline {' '.join(args)}: {done.stdout}{done.stderr}"
    return done


def test_the_view_is_read_without_our_code(
    broker: str, make_topic, group_id: str, tmp_path: Path
) -> None:
    polars = pytest.importorskip("polars")
    duckdb = pytest.importorskip("duckdb")
    topic = make_topic(partitions=2)
    publish_raw(broker, topic, [(f"d{i % 7}".encode(), value(f"text {i}")) for i in range(30)])
    output = tmp_path / "out"
    assert run_until_end(broker, topic, group_id, output, "--write-mode", "upsert").returncode == 0
    dataset = lance.dataset(str(output / "current"))
    assert dataset.count_rows() == 7
    frame = polars.scan_pyarrow_dataset(dataset).select("doc_key", "text").collect()
    assert frame.height == 7
    keys = duckdb.sql("SELECT count(DISTINCT doc_key) FROM dataset").fetchall()
    assert keys == [(7,)]
    table = dataset.to_table()
    assert table.schema.field("embedding").type.list_size == 384


def test_updates_and_deletes_land_once_through_a_sigkill(
    broker: str, make_topic, group_id: str, tmp_path: Path, tiny_model: str
) -> None:
    topic = make_topic(partitions=3)
    rng = random.Random(11)
    items: list[tuple[bytes, bytes | None]] = []
    for i in range(3000):
        key = f"doc-{rng.randrange(400)}".encode()
        items.append((key, None if rng.random() < 0.1 else value(f"version {i} of {key!r}")))
    # Keyed by document, as producers should: one key stays in one partition.
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=broker, acks="all")
    for key, item in items:
        producer.send(topic, key=key, value=item)
    producer.flush(30)
    producer.close()
    output = tmp_path / "out"
    extra = ("--write-mode", "upsert", "--model", tiny_model, "--batch-size", "64",
             "--view-sync-interval-s", "0.2")  # fmt: skip
    worker = start_worker(broker, topic, group_id, output, *extra, log=tmp_path / "w1.log")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(output_rows(output)) < 800:
        time.sleep(0.05)
    stop(worker, signal.SIGKILL)
    done = run_until_end(broker, topic, group_id, output, *extra)
    assert done.returncode == 0, done.stderr
    rows = output_rows(output)
    assert not duplicates(rows)
    assert len(rows) == len(items)
    expected = expected_live(broker, topic)
    assert {k: r["text"] for k, r in view_rows(output).items()} == expected
    for path in (output / "vectors").glob("*.parquet"):
        table = pq.read_table(path, columns=["doc_key", "deleted", "text"])
        assert all(
            not d or t == ""
            for d, t in zip(table["deleted"].to_pylist(), table["text"].to_pylist(), strict=True)
        )
