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
    committed_offsets,
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
    status = pipeline(broker, "status", "--group", group_id, "--output", str(output), "--json")
    (partition,) = json.loads(status.stdout)["partitions"]
    assert partition["view_through"] == partition["covered_through"] == 5
    assert partition["mismatch"] is None  # a tombstone's row has no vector: no false alarm
    pipeline(broker, "compact", "--output", str(output))  # the view's upkeep too
    assert {k: r["text"] for k, r in view_rows(output).items()} == {
        "doc1": "The cafeteria now serves curry on Mondays.",
        "doc3": "The library opens at nine.",
    }
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


def publish_keyless_tombstone(broker: str, topic: str, between: list[tuple[bytes, bytes]]) -> None:
    """`between[0]`, a record with neither key nor value, then the rest, in partition 0
    (kafka-python's send refuses key=None with value=None: the key goes in as a marker
    that a serializer writes as a null key)."""
    from kafka import KafkaProducer
    from kafka.serializer import Serializer

    null_key = object()

    class Keys(Serializer):
        def serialize(self, topic, headers, data):
            return None if data is null_key else data

    producer = KafkaProducer(bootstrap_servers=broker, acks="all", key_serializer=Keys())
    first, *rest = between
    producer.send(topic, key=first[0], value=first[1], partition=0)
    producer.send(topic, key=null_key, value=None, partition=0)
    for key, item in rest:
        producer.send(topic, key=key, value=item, partition=0)
    producer.flush(30)
    producer.close()


def test_a_tombstone_with_no_key_is_dead_lettered_once_and_the_worker_goes_on(
    broker: str, make_topic, group_id: str, tmp_path: Path, tiny_model: str
) -> None:
    topic = make_topic(partitions=1)
    publish_keyless_tombstone(broker, topic, [(b"doc1", value("one")), (b"doc2", value("two"))])
    (keyless,) = [r for r in read_topic(broker, topic) if r.key is None]
    assert keyless.value is None and keyless.offset == 1
    output = tmp_path / "out"
    extra = ("--write-mode", "upsert", "--model", tiny_model)
    for _ in range(2):  # it crashed on every restart: the second run must also exit 0
        done = run_until_end(broker, topic, group_id, output, *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        (dead,) = read_topic(broker, f"{topic}.dlq", timeout_s=30)
        assert (dead.key, dead.value) == (None, None)
        headers = dict(dead.headers)
        assert headers["error.class"] == b"MissingDocumentKey"
        assert (headers["source.partition"], headers["source.offset"]) == (b"0", b"1")
    assert {k: r["text"] for k, r in view_rows(output).items()} == {"doc1": "one", "doc2": "two"}
    assert committed_offsets(broker, group_id, topic) == {0: 3}
    pipeline(broker, "audit", "--group", group_id, "--topic", topic, "--output", str(output))


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


def publish_documents(broker: str, topic: str, count: int, keys: int, seed: int) -> None:
    """Versions of `keys` documents, a tenth of them tombstones, keyed by document (the
    producer's partitioner keeps one key in one partition)."""
    from kafka import KafkaProducer

    rng = random.Random(seed)
    producer = KafkaProducer(bootstrap_servers=broker, acks="all", linger_ms=5)
    for i in range(count):
        key = f"doc-{rng.randrange(keys)}"
        item = None if rng.random() < 0.1 else value(f"version {i} of {key}", id=key)
        producer.send(topic, key=key.encode(), value=item)
    producer.flush(30)
    producer.close()


def the_view(output: str | Path) -> dict[str, dict]:
    """The current view as Lance reads it, from a directory or an s3:// URL."""
    from sinks.objectstore import ObjectStore

    if isinstance(output, Path):
        return view_rows(output)
    store = ObjectStore.from_url(output)
    uri = f"{output.rstrip('/')}/current"
    rows = lance.dataset(uri, storage_options=store.connection_options()).to_table().to_pylist()
    assert len(rows) == len({r["doc_key"] for r in rows}), "one row per live document"
    return {r["doc_key"]: r for r in rows}


def history_rows(output: str | Path, tmp_path: Path) -> list[tuple[str, int, int]]:
    if isinstance(output, Path):
        return output_rows(output)
    from tests.test_s3_output import mirror

    return output_rows(mirror(output, tmp_path / "mirror"))


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_updates_and_deletes_land_once_through_a_sigkill(
    broker: str, make_topic, group_id: str, tmp_path: Path, tiny_model: str, where: str, request
) -> None:
    topic = make_topic(partitions=3)
    publish_documents(broker, topic, 3000, keys=400, seed=11)
    output: str | Path = request.getfixturevalue("s3_url") if where == "s3" else tmp_path / "out"
    # A short session: the run to the end joins once the group has dropped the killed
    # worker (at the default 45 s it waited 42 s for that).
    extra = ("--write-mode", "upsert", "--model", tiny_model, "--batch-size", "64",
             "--view-sync-interval-s", "0.2", "--session-timeout-ms", "6000")  # fmt: skip
    worker = start_worker(broker, topic, group_id, output, *extra, log=tmp_path / "w1.log")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and worker.poll() is None:
        committed = committed_offsets(broker, group_id, topic)
        if sum(o or 0 for o in committed.values()) >= 800:
            break
        time.sleep(0.05)
    stop(worker, signal.SIGKILL)
    done = run_until_end(broker, topic, group_id, output, *extra)
    assert done.returncode == 0, done.stderr
    rows = history_rows(output, tmp_path)
    assert not duplicates(rows)
    assert len(rows) == 3000
    assert {k: r["text"] for k, r in the_view(output).items()} == expected_live(broker, topic)
    for command in (["audit", "--group", group_id, "--topic", topic], ["index", "check"]):
        pipeline(broker, *command, "--output", str(output))
    # Search never returns a superseded or deleted version.
    live = the_view(output)
    hits = json.loads(
        pipeline(broker, "search", "--output", str(output), "--json", "-k", "20", "version")
        .stdout
    )["hits"]  # fmt: skip
    assert hits and all(live[h["doc_key"]]["offset"] == h["offset"] for h in hits)
    # Erasure, there too: afterwards the history holds the live versions only.
    pipeline(broker, "compact", "--purge", "--output", str(output))
    for command in (["audit", "--group", group_id, "--topic", topic], ["index", "check"]):
        pipeline(broker, *command, "--output", str(output))
    history = tmp_path / "after-purge"
    if isinstance(output, Path):
        history = output
    else:
        from tests.test_s3_output import mirror

        mirror(output, history)
    kept = []
    for path in (history / "vectors").glob("*.parquet"):
        table = pq.read_table(path, columns=["doc_key", "text"])
        kept += zip(table["doc_key"].to_pylist(), table["text"].to_pylist(), strict=True)
    assert sorted(kept) == sorted((k, r["text"]) for k, r in the_view(output).items())


def test_purges_while_a_worker_writes_lose_nothing_and_resurrect_nothing(
    broker: str, make_topic, group_id: str, tmp_path: Path, tiny_model: str
) -> None:
    import threading

    topic = make_topic(partitions=2)
    publish_documents(broker, topic, 1500, keys=200, seed=5)
    output = tmp_path / "out"
    extra = ("--write-mode", "upsert", "--model", tiny_model, "--batch-size", "64",
             "--view-sync-interval-s", "0.2")  # fmt: skip
    worker = start_worker(broker, topic, group_id, output, *extra, log=tmp_path / "w.log")
    more = threading.Thread(target=publish_documents, args=(broker, topic, 1500, 200, 6))
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (output / "current").is_dir():
            time.sleep(0.1)
        more.start()
        for _ in range(3):  # purges while the worker writes, applies and syncs
            pipeline(broker, "compact", "--purge", "--output", str(output))
        more.join()
    finally:
        stop(worker)
    done = run_until_end(broker, topic, group_id, output, *extra)
    assert done.returncode == 0, done.stderr
    for command in (["audit", "--group", group_id, "--topic", topic], ["index", "check"]):
        pipeline(broker, *command, "--output", str(output))
    live = expected_live(broker, topic)
    assert {k: r["text"] for k, r in view_rows(output).items()} == live
    pipeline(broker, "compact", "--purge", "--output", str(output))
    pipeline(broker, "audit", "--group", group_id, "--topic", topic, "--output", str(output))
    kept: list[tuple[str, str]] = []
    for path in (output / "vectors").glob("*.parquet"):
        table = pq.read_table(path, columns=["doc_key", "text"])
        kept += zip(table["doc_key"].to_pylist(), table["text"].to_pylist(), strict=True)
    assert sorted(kept) == sorted(live.items())  # only the live versions are left


def test_chunked_documents_are_replaced_and_deleted_whole(
    broker: str, make_topic, group_id: str, tmp_path: Path
) -> None:
    """An update replaces all of a document's chunks, whatever their number before and
    after; a delete removes them all; search finds live chunks only."""
    sentence = "The turbine controller logs every vibration alarm with its rotor speed. "
    topic = make_topic(partitions=1)
    versions = [
        (b"manual", value(sentence * 30)),  # many chunks
        (b"ticket", value("Ticket 42: the pump in hall B leaks oil near the seal. " * 25)),
        (b"manual", value("The manual moved to the new wiki.")),  # one chunk
        (b"manual", value("Reset the controller by holding the red button. " * 12)),
        (b"ticket", None),
    ]
    publish_raw(broker, topic, versions)
    output = tmp_path / "out"
    extra = ("--write-mode", "upsert", "--chunk-tokens", "48", "--chunk-overlap", "8")
    done = run_until_end(broker, topic, group_id, output, *extra)
    assert done.returncode == 0, done.stderr
    rows = lance.dataset(str(output / "current")).to_table().to_pylist()
    assert {r["doc_key"] for r in rows} == {"manual"}
    latest = json.loads(versions[3][1])["text"]  # type: ignore[arg-type]
    chunks = sorted(rows, key=lambda r: r["chunk"])
    assert {r["offset"] for r in chunks} == {3}
    assert [r["chunk"] for r in chunks] == list(range(chunks[0]["chunk_count"]))
    assert len(chunks) > 1
    assert all(r["text"] == latest[r["char_start"] : r["char_end"]] for r in chunks)
    hits = search(output, "pump in hall B leaks oil", broker)
    assert all(h["offset"] == 3 for h in hits), "only the live version's chunks are found"
    hits = search(output, "vibration alarm rotor speed", broker)
    assert all("vibration" not in h["text"] for h in hits)
    checks = (["audit", "--group", group_id, "--topic", topic], ["index", "check"])
    for command in checks:
        assert pipeline(broker, *command, "--output", str(output)).returncode == 0
    pipeline(broker, "compact", "--purge", "--output", str(output))
    raw = b"".join(p.read_bytes() for p in output.rglob("*") if p.is_file())
    for erased in (b"vibration alarm", b"leaks oil", b"new wiki"):
        assert erased not in raw
    for command in checks:
        assert pipeline(broker, *command, "--output", str(output)).returncode == 0
