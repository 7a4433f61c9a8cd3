"""Foreign producers for integration tests: the official Java client
(scripts/java/ForeignProducer.java) and kafka-python's own producer, both with compressed
batches; an independent read_committed view of a topic; the batches the broker stored."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

REPO = Path(__file__).resolve().parents[1]
JAVA_SOURCE = REPO / "scripts" / "java" / "ForeignProducer.java"
DEV_KAFKA = REPO / "scripts" / "dev-kafka.sh"
# Start-up flags for a short-lived client: the C1 JIT only (the source launcher compiles the
# program at every run; this roughly halves that), a small heap.
JAVA_FLAGS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-Xmx256m")
CODECS = ("gzip", "snappy", "lz4", "zstd")
# The compression codes of the record batch attributes (bits 0-2).
CODEC_IDS = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}

Offset = tuple[str, int, int]  # (topic, partition, offset)


# ------------------------------------------------------------------ the Java producer


@functools.lru_cache(maxsize=1)
def java_classpath() -> str:
    """The cached Kafka jars (scripts/dev-kafka.sh classpath fetches them if missing)."""
    done = subprocess.run(
        [str(DEV_KAFKA), "classpath"], capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode != 0:
        raise AssertionError(f"dev-kafka.sh classpath failed:\n{done.stderr}")
    return done.stdout.strip().splitlines()[-1]


def java_produce(
    bootstrap: str,
    topic: str,
    count: int,
    *,
    compression: str = "none",
    transactions: str = "none",
    per_transaction: int = 10,
    partitions: int | None = None,
    start_id: int = 0,
    timeout: float = 180,
) -> dict[str, Any]:
    """Publishes `count` records with the official Java client; returns its summary:
    {"sent", "partitions", "committed_ids", "aborted_ids", ...}. Skips without java."""
    java = shutil.which("java")
    if java is None:
        pytest.skip("java is not installed")
    args = [
        *("--bootstrap", bootstrap, "--topic", topic, "--count", str(count)),
        *("--compression", compression, "--transactions", transactions),
        *("--per-transaction", str(per_transaction), "--start-id", str(start_id)),
    ]
    if partitions is not None:
        args += ["--partitions", str(partitions)]
    command = [java, *JAVA_FLAGS, "-cp", java_classpath(), str(JAVA_SOURCE), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise AssertionError(
            f"ForeignProducer exited {done.returncode}:\n{done.stderr}\n{done.stdout}"
        )
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert lines, f"ForeignProducer printed nothing; stderr:\n{done.stderr}"
    summary: dict[str, Any] = json.loads(lines[-1])
    assert summary["sent"] == count, summary
    return summary


# ------------------------------------------------------------------ kafka-python's producer


def sentence(n: int) -> str:
    """A deterministic, varied text (every third one not English)."""
    things = ["tides", "lanterns", "orchards", "glaciers", "markets", "violins", "ferries"]
    moods = ["slowly", "loudly", "in secret", "every morning", "without a map"]
    if n % 3 == 2:
        return f"第{n}条消息：城市的{['灯光', '河流', '街道'][(n // 3) % 3]}很安静。"
    return f"Record {n}: the {things[n % len(things)]} move {moods[(n // 7) % len(moods)]}."


def python_produce(
    bootstrap: str, topic: str, count: int, compression: str, partitions: int
) -> list[str]:
    """Publishes `count` JSON records with kafka-python's producer and `compression`
    ("none" for plain batches), partition n % partitions; returns the ids."""
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        compression_type=None if compression == "none" else compression,
        linger_ms=50,
        batch_size=1 << 20,
    )
    ids: list[str] = []
    try:
        futures = []
        for n in range(count):
            ids.append(f"py-{n}")
            value = json.dumps({"id": ids[-1], "text": sentence(n)}, ensure_ascii=False)
            futures.append(
                producer.send(
                    topic, key=f"k-{n}".encode(), value=value.encode(), partition=n % partitions
                )
            )
        producer.flush(60)
        for future in futures:
            future.get(timeout=60)
    finally:
        producer.close(timeout=30)
    return ids


# ------------------------------------------------------------------ independent reads


@dataclass(frozen=True)
class Record:
    id: str | None
    text: str


def committed_records(bootstrap: str, topic: str, timeout_s: float = 30) -> dict[Offset, Record]:
    """Every record of `topic` a read_committed consumer sees (assign, seek to the
    beginning, read to the end offsets), by (topic, partition, offset)."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        isolation_level="read_committed",
    )
    try:
        partitions = [
            TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))
        ]
        consumer.assign(partitions)
        consumer.seek_to_beginning()
        ends = consumer.end_offsets(partitions)
        found: dict[Offset, Record] = {}
        for record in _read_to(consumer, ends, timeout_s):
            value = json.loads(record.value.decode("utf-8"))
            found[(record.topic, record.partition, record.offset)] = Record(
                value["id"], value["text"]
            )
        return found
    finally:
        consumer.close(autocommit=False)


def _read_to(
    consumer: KafkaConsumer, ends: dict[TopicPartition, int], timeout_s: float
) -> Iterator[Any]:
    deadline = time.monotonic() + timeout_s
    while not all(consumer.position(tp) >= end for tp, end in ends.items()):
        if time.monotonic() > deadline:
            positions = {tp.partition: consumer.position(tp) for tp in ends}
            raise AssertionError(f"read_committed consumer stuck at {positions}, ends {ends}")
        for batch in consumer.poll(timeout_ms=200).values():
            yield from batch


def output_records(output: Path) -> list[tuple[Offset, Record]]:
    """(topic, partition, offset) and (id, text) of every Parquet row under output/vectors."""
    rows: list[tuple[Offset, Record]] = []
    columns = ["topic", "partition", "offset", "id", "text"]
    for path in sorted((output / "vectors").glob("*.parquet")):
        table = pq.read_table(path, columns=columns).to_pydict()
        for topic, partition, offset, id_, text in zip(*(table[c] for c in columns), strict=True):
            rows.append(((topic, partition, offset), Record(id_, text)))
    return rows


# ------------------------------------------------------------------ what the broker stored


@dataclass(frozen=True)
class StoredBatch:
    partition: int
    base_offset: int
    last_offset: int
    records: int
    codec: int
    transactional: bool
    control: bool


def stored_batches(topic: str) -> list[StoredBatch] | None:
    """The record batches of `topic` in the local dev broker's log files (scripts/dev-kafka.sh
    keeps them next to the jars), or None when the broker's data is not on this machine."""
    from kafka.record import MemoryRecords

    data = Path(java_classpath()).parent.parent / "data"
    dirs = sorted(data.glob(f"{topic}-*"))
    if not dirs:
        return None
    batches: list[StoredBatch] = []
    for directory in dirs:
        partition = int(directory.name.rsplit("-", 1)[1])
        for log in sorted(directory.glob("*.log")):
            records = MemoryRecords(log.read_bytes())
            while (batch := records.next_batch()) is not None:
                batches.append(
                    StoredBatch(
                        partition,
                        batch.base_offset,
                        batch.last_offset,
                        batch.records_count,
                        batch.compression_type,
                        batch.is_transactional,
                        batch.is_control_batch,
                    )
                )
    return batches
