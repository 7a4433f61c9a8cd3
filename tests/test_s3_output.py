"""`--output s3://bucket/prefix` against a real S3-compatible server (SeaweedFS,
scripts/dev-s3.sh) and the real broker.

Workers run as separate processes with different host names, temp directories
and working directories, as on separate machines, sharing one bucket prefix.
Each test ends with an independent check: the objects are downloaded with
boto3 (not the pipeline's own store) and every Kafka offset is counted in the
Parquet rows and in the index's newest manifest.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import faiss
import numpy as np
import pytest

from pipeline.core.layout import SegmentKey
from pipeline.core.records import SourceRecord
from sinks.index.store import IndexStore, decode_id
from tests.helpers import (
    PIPELINE,
    REPO,
    committed_offsets,
    corpus_records,
    duplicates,
    output_rows,
    publish_json,
    worker_args,
    worker_env,
)
from tests.test_rebalance import FAST_GROUP, partition_ends

pytestmark = [pytest.mark.integration]

Row = tuple[str, int, int]


@pytest.fixture
def model(tiny_model: str) -> tuple[str, str]:
    return ("--model", tiny_model)


# -- an independent reading of the bucket -------------------------------------------


def _boto3_client():
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=os.environ["PIPELINE_S3_ENDPOINT"],
        config=Config(request_checksum_calculation="when_required"),
    )


def _split(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.netloc, parts.path.strip("/") + "/"


def mirror(url: str, dest: Path) -> Path:
    """Downloads every object under the URL's prefix into `dest` (keys as paths)."""
    client = _boto3_client()
    bucket, prefix = _split(url)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    for page in pages:
        for item in page.get("Contents", []):
            target = dest / item["Key"][len(prefix) :]
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, item["Key"], str(target))
    return dest


def mirrored_index_rows(dest: Path) -> list[Row]:
    """The entries of the newest manifest's shards, read with faiss itself."""
    manifests = sorted((dest / "index").glob("manifest-*.json"))
    assert manifests, "no index manifest"
    meta = json.loads(manifests[-1].read_text())
    topics = {no: name for name, no in meta["topics"].items()}
    rows: list[Row] = []
    for shard in meta["shards"]:
        index = faiss.read_index(str(dest / "index" / shard["file"]))
        assert index.ntotal == shard["count"]
        ids = faiss.vector_to_array(index.id_map).astype(np.int64)
        rows += [(topics[t], p, o) for t, p, o in (decode_id(int(i)) for i in ids)]
    return rows


def assert_every_offset_once(broker: str, topic: str, group: str, url: str, dest: Path) -> None:
    mirror(url, dest)
    rows = output_rows(dest)  # the mirror is laid out like a local output
    ends = partition_ends(broker, topic)
    expected = {(topic, p, o) for p, end in ends.items() for o in range(end)}
    assert duplicates(rows) == [], "doubled rows"
    missing = expected - set(rows)
    assert not missing, f"{len(missing)} offsets lost, e.g. {sorted(missing)[:5]}"
    assert set(rows) == expected
    assert sorted(mirrored_index_rows(dest)) == sorted(rows)
    assert committed_offsets(broker, group, topic) == ends
    assert not list((dest / "vectors").glob(".*")), "temp objects left behind"


# -- workers as on separate machines ------------------------------------------------


def machine(tmp_path: Path, name: str) -> dict[str, object]:
    """A working directory, temp directory and host name of its own."""
    home = tmp_path / name
    (home / "tmp").mkdir(parents=True)
    return {"cwd": home, "HOSTNAME": f"{name}.example", "TMPDIR": str(home / "tmp")}


def start_on(
    where: dict[str, object], broker: str, topic: str, group: str, url: str, *extra: str
) -> subprocess.Popen[bytes]:
    env = worker_env(broker)
    env.update(HOSTNAME=str(where["HOSTNAME"]), TMPDIR=str(where["TMPDIR"]))
    cwd = Path(str(where["cwd"]))
    log = open(cwd / "worker.log", "ab")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        worker_args(topic, group, url, *extra), env=env, cwd=cwd, stdout=log, stderr=log
    )


def run_to_end_on(
    where: dict[str, object], broker: str, topic: str, group: str, url: str, *extra: str
) -> subprocess.CompletedProcess[str]:
    env = worker_env(broker)
    env.update(HOSTNAME=str(where["HOSTNAME"]), TMPDIR=str(where["TMPDIR"]))
    return subprocess.run(
        [*worker_args(topic, group, url, *extra), "--until-end"],
        env=env,
        cwd=Path(str(where["cwd"])),
        capture_output=True,
        text=True,
        timeout=600,
    )


def logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in tmp_path.glob("*/worker.log"))


def wait_for_objects(url: str, prefix: str, at_least: int, timeout: float = 90) -> None:
    client = _boto3_client()
    bucket, root = _split(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = client.list_objects_v2(Bucket=bucket, Prefix=root + prefix)
        if listed.get("KeyCount", 0) >= at_least:
            return
        time.sleep(0.5)
    raise AssertionError(f"fewer than {at_least} objects under {prefix} after {timeout}s")


@pytest.mark.slow
def test_workers_on_three_machines_share_one_s3_output_exactly_once(
    broker, make_topic, group_id, s3_url, tmp_path, model
):
    """Two workers on one bucket prefix; one stalled past its session timeout (SIGSTOP)
    while the other takes its partitions and records keep coming, then resumed; the
    other SIGKILLed mid-run; a third machine runs to the end. Every offset once."""
    topic = make_topic(partitions=4)
    publish_json(broker, topic, corpus_records(600), partitions=4)
    options = ("--batch-size", "32", *FAST_GROUP, *model)
    a, b, c = (machine(tmp_path, name) for name in ("a", "b", "c"))
    first = start_on(a, broker, topic, group_id, s3_url, *options)
    second = start_on(b, broker, topic, group_id, s3_url, *options)
    try:
        wait_for_objects(s3_url, "vectors/", 4)
        first.send_signal(signal.SIGSTOP)
        publish_json(broker, topic, corpus_records(400, seed=1), partitions=4)
        time.sleep(12)  # evicted; the other worker owns every partition now
        first.send_signal(signal.SIGCONT)
        publish_json(broker, topic, corpus_records(300, seed=2), partitions=4)
        time.sleep(4)
        second.send_signal(signal.SIGKILL)
        time.sleep(6)
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
            proc.wait(timeout=120)

    result = run_to_end_on(c, broker, topic, group_id, s3_url, *options)

    assert result.returncode == 0, result.stderr[-3000:] + logs(tmp_path)
    assert_every_offset_once(broker, topic, group_id, s3_url, tmp_path / "mirror")
    for where in (a, b, c):  # nothing written in the machines' working directories
        assert {p.name for p in Path(str(where["cwd"])).iterdir()} <= {"tmp", "worker.log"}


def test_status_audit_search_and_index_check_read_the_s3_output(
    broker, make_topic, group_id, s3_url, tmp_path, model
):
    topic = make_topic(partitions=2)
    publish_json(broker, topic, corpus_records(120), partitions=2)
    where = machine(tmp_path, "a")
    result = run_to_end_on(where, broker, topic, group_id, s3_url, *model)
    assert result.returncode == 0, result.stderr[-3000:]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*PIPELINE, *args], env=worker_env(broker), cwd=REPO, capture_output=True, text=True
        )

    status = cli("status", "--group", group_id, "--output", s3_url, "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert sorted(
        (p["partition"], p["rows"], p["index_entries"]) for p in report["partitions"]
    ) == [
        (0, 60, 60),
        (1, 60, 60),
    ]
    audit = cli("audit", "--group", group_id, "--output", s3_url)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    check = cli("index", "check", "--output", s3_url, "--json")
    assert check.returncode == 0, check.stdout + check.stderr
    assert json.loads(check.stdout)["missing"] == 0
    text = corpus_records(120)[7]["text"]
    found = cli("search", "--output", s3_url, "--json", "-k", "1", text)
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["hits"][0]["text"] == text
    compact = cli("compact", "--output", s3_url)
    assert compact.returncode != 0
    assert "not supported" in compact.stderr
    assert len(compact.stderr.strip().splitlines()) == 1


def test_a_damaged_object_is_moved_aside_and_read_again(
    broker, make_topic, group_id, s3_url, tmp_path, model
):
    topic = make_topic(partitions=1)
    publish_json(broker, topic, corpus_records(90), partitions=1)
    options = ("--batch-size", "30", *model)
    where = machine(tmp_path, "a")
    assert run_to_end_on(where, broker, topic, group_id, s3_url, *options).returncode == 0
    client = _boto3_client()
    bucket, prefix = _split(s3_url)
    keys = sorted(
        o["Key"]
        for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "vectors/")["Contents"]
    )
    assert len(keys) == 3
    client.put_object(Bucket=bucket, Key=keys[1], Body=b"not parquet at all")

    result = run_to_end_on(where, broker, topic, group_id, s3_url, *options)

    assert result.returncode == 0, result.stderr[-3000:]
    assert "damaged segment" in result.stderr
    quarantined = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "quarantine/")["Contents"]
    assert any(o["Key"].endswith(".json") for o in quarantined)
    assert_every_offset_once(broker, topic, group_id, s3_url, tmp_path / "mirror")


# -- the index on an object store ----------------------------------------------------


def _write_segment(url: str, topic: str, partition: int, first: int, count: int) -> None:
    from pipeline.core.model_info import ModelInfo
    from pipeline.core.records import GoodRecord
    from sinks.objectstore import ObjectStore
    from sinks.parquet import ParquetSink

    info = ModelInfo("m", "/m", "r", 8, "mean", True, 16, "fp32", "cpu")
    sink = ParquetSink(ObjectStore.from_url(url), info)
    records = [
        GoodRecord(SourceRecord(topic, partition, o, 0, None, b"{}"), f"t{o}", None, None)
        for o in range(first, first + count)
    ]
    vectors = np.random.default_rng(first).random((count, 8), dtype=np.float32)
    staged = sink.stage(
        SegmentKey(topic, partition, first), first + count - 1, records, vectors, count
    )
    assert sink.publish(staged)


def test_index_writers_racing_on_one_prefix_commit_every_vector_once(s3_url, monkeypatch):
    """Four index stores (as four workers) sync while segments keep arriving: every
    commit is a create-if-absent of the next manifest, losers sync again."""
    from sinks.index import files as index_files
    from sinks.objectstore import ObjectStore

    monkeypatch.setattr(index_files, "GRACE_S", 5.0)  # collect unlisted shards soon
    store = ObjectStore.from_url(s3_url)
    stores = [IndexStore(store, shard_cap=64) for _ in range(4)]
    done = threading.Event()
    errors: list[BaseException] = []

    def syncing(index: IndexStore) -> None:
        try:
            while not done.is_set():
                index.sync()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=syncing, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    expected = set()
    for first in range(0, 600, 20):
        for partition in (0, 1):
            _write_segment(s3_url, "t", partition, first, 20)
            expected |= {("t", partition, o) for o in range(first, first + 20)}
    time.sleep(1.0)
    done.set()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    time.sleep(5.5)  # past the grace period: one more commit collects what no list names
    _write_segment(s3_url, "t", 0, 600, 20)
    expected |= {("t", 0, o) for o in range(600, 620)}
    final = IndexStore(store)
    assert final.sync() > 0
    meta, ids, _ = final.snapshot()
    assert meta is not None
    topics = {no: name for name, no in meta.topics.items()}
    rows = [(topics[t], p, o) for t, p, o in (decode_id(int(i)) for i in ids)]
    assert duplicates(rows) == []
    assert set(rows) == expected
    assert meta.generation > 1
    # Shards merged away or of lost commits were removed: what remains is what the
    # kept manifests name (the newest and a few before it, for readers still on them).
    listed = {o.key.split("/", 1)[1] for o in store.list("index/")}
    manifests = sorted(n for n in listed if re.fullmatch(r"manifest-\d+\.json", n))
    assert len(manifests) <= index_files.KEEP_MANIFESTS + 1
    named: set[str] = set()
    for manifest in manifests:
        named |= {s["file"] for s in json.loads(store.get(f"index/{manifest}"))["shards"]}
    shards = {n for n in listed if n.endswith(".faiss")}
    assert shards == named
    assert {s.file for s in meta.shards} <= shards


def test_a_footer_costs_one_request_and_an_outage_is_not_damage(s3_url):
    from pathlib import PurePosixPath

    from pipeline.core.errors import OutputError
    from pipeline.core.layout import SegmentFile, iter_segments
    from sinks.objectstore import ObjectStore
    from sinks.segments import DamagedSegment, read_info

    _write_segment(s3_url, "t", 3, 100, 50)
    store = ObjectStore.from_url(s3_url)
    (segment,) = iter_segments(store)
    gets: list[object] = []
    store._client.meta.events.register("before-call.s3.GetObject", lambda **kw: gets.append(kw))
    info = read_info(segment)
    assert (info.first, info.last, info.rows) == (100, 149, 50)
    assert len(gets) == 1

    unreachable = ObjectStore.from_url(
        s3_url, endpoint="http://127.0.0.1:9", connect_timeout=0.5, max_attempts=1
    )
    gone = SegmentFile.parse(PurePosixPath(str(segment.path)), unreachable)
    assert gone is not None
    with pytest.raises(OutputError) as raised:
        read_info(gone)
    assert not isinstance(raised.value, DamagedSegment)
