"""Helpers for integration tests: publish, run workers as real processes, read outputs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

REPO = Path(__file__).resolve().parents[1]
PIPELINE = [sys.executable, "-m", "pipeline.cli"]


def publish_json(
    bootstrap: str, topic: str, records: Iterable[dict[str, Any]], partitions: int = 1
) -> int:
    """Publishes JSON objects round-robin over the partitions; returns the count."""
    values = (json.dumps(r).encode() for r in records)
    return publish_raw(bootstrap, topic, ((None, v) for v in values), partitions)


def publish_raw(
    bootstrap: str,
    topic: str,
    items: Iterable[tuple[bytes | None, bytes | None]],
    partitions: int = 1,
    headers: Callable[[int], list[tuple[str, bytes]]] = lambda n: [],
    **producer_config: Any,
) -> int:
    """Publishes (key, value) pairs round-robin over the partitions, the n-th (from 0)
    with `headers(n)`; returns the count."""
    producer = KafkaProducer(
        bootstrap_servers=bootstrap, acks="all", linger_ms=5, **producer_config
    )
    n = 0
    for n, (key, value) in enumerate(items, 1):
        producer.send(
            topic, key=key, value=value, headers=headers(n - 1), partition=(n - 1) % partitions
        )
    producer.flush(30)
    producer.close()
    return n


class RawHeaderKey(str):
    """A record header key that kafka-python's producer writes as the given bytes, which
    need not be UTF-8 (Go clients and librdkafka's C API take header keys as bytes):
    the producer writes `key.encode("utf-8")`."""

    raw: bytes

    def __new__(cls, raw: bytes) -> RawHeaderKey:
        key = super().__new__(cls, raw.decode("utf-8", "replace"))
        key.raw = raw
        return key

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return self.raw


# Header keys that are not UTF-8: stray bytes, Latin-1, an encoded UTF-16 surrogate, a
# sequence cut short.
NOT_UTF8_KEYS = (b"\xff\xfe", b"caf\xe9", b"\xed\xa0\x80", b"\xc3")


def publish_with_keys_not_utf8(
    bootstrap: str, topic: str, records: Sequence[dict[str, Any]], partitions: int = 1
) -> int:
    """Publishes JSON objects round-robin over the partitions (lz4), every third with a
    header key that is not UTF-8 before a plain one; returns the count."""

    def headers(n: int) -> list[tuple[str, bytes]]:
        plain = [("trace", b"%d" % n)]
        if n % 3:
            return plain
        return [(RawHeaderKey(NOT_UTF8_KEYS[n % len(NOT_UTF8_KEYS)]), b"v"), *plain]

    items = ((None, json.dumps(r).encode()) for r in records)
    return publish_raw(bootstrap, topic, items, partitions, headers, compression_type="lz4")


def corpus_records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    from pipeline.core.corpus import sample_texts

    texts = sample_texts(n, seed)
    while len(texts) < n:  # the stdlib corpus has ~8,000 paragraphs; repeat for more
        texts += [f"{t} ({len(texts)})" for t in texts[: n - len(texts)]]
    return [{"id": f"doc-{i}", "text": t, "lang": "en"} for i, t in enumerate(texts[:n])]


def worker_env(bootstrap: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PIPELINE_BOOTSTRAP_SERVERS=bootstrap,
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


def worker_args(topic: str | Sequence[str], group: str, output: Path, *extra: str) -> list[str]:
    topics = [topic] if isinstance(topic, str) else list(topic)
    args = [*PIPELINE, "run", "--group", group, "--output", str(output), "--no-progress"]
    for t in topics:
        args += ["--topic", t]
    if "--precision" not in extra:
        args += ["--precision", "fp32"]
    return [*args, *extra]


def start_worker(
    bootstrap: str,
    topic: str | Sequence[str],
    group: str,
    output: Path,
    *extra: str,
    log: Path | None = None,
) -> subprocess.Popen[bytes]:
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        worker_args(topic, group, output, *extra),
        env=worker_env(bootstrap),
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def run_until_end(
    bootstrap: str,
    topic: str | Sequence[str],
    group: str,
    output: Path,
    *extra: str,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*worker_args(topic, group, output, *extra), "--until-end"],
        env=worker_env(bootstrap),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def log_count(log: Path, pattern: str) -> int:
    """How many times the regex `pattern` matches in `log` (0 before it exists)."""
    return len(re.findall(pattern, log.read_text(errors="replace"))) if log.exists() else 0


def wait_for_log(
    log: Path,
    pattern: str,
    count: int = 1,
    proc: subprocess.Popen[bytes] | None = None,
    timeout: float = 180,
) -> None:
    """Until the regex `pattern` matches `count` times in `log`: a phase a worker
    reached, not a guess at how long it takes on a loaded machine."""
    deadline = time.monotonic() + timeout
    while log_count(log, pattern) < count:
        exited = proc is not None and proc.poll() is not None
        if exited or time.monotonic() > deadline:
            why = f"the worker exited {proc.returncode}" if exited and proc else f"{timeout:.0f}s"
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise AssertionError(f"{pattern!r} not {count} time(s) in {log} ({why}):\n{tail}")
        time.sleep(0.1)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 120) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout=timeout)


def output_rows(output: Path) -> list[tuple[str, int, int]]:
    """(topic, partition, offset) of every Parquet row under output/vectors."""
    rows: list[tuple[str, int, int]] = []
    for path in sorted((output / "vectors").glob("*.parquet")):
        table = pq.read_table(path, columns=["topic", "partition", "offset"])
        rows += zip(
            table["topic"].to_pylist(),
            table["partition"].to_pylist(),
            table["offset"].to_pylist(),
            strict=True,
        )
    return rows


def duplicates(rows: Sequence[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    return [row for row, count in Counter(rows).items() if count > 1]


def index_rows(output: Path) -> list[tuple[str, int, int]]:
    """(topic, partition, offset) of every id in the index: one per vector, so one per
    chunk row in an output of chunks (as output_rows gives one per Parquet row)."""
    from sinks.index.store import IndexStore

    store = IndexStore(output)
    store.load()
    assert store.meta is not None
    topics = {no: name for name, no in store.meta.topics.items()}
    decode = store.meta.layout.decode
    return [(topics[t], p, o) for t, p, o, _ in (decode(int(i)) for i in store.ids())]


def read_topic(bootstrap: str, topic: str, timeout_s: float = 10) -> list[Any]:
    """Every record of a topic, read without a group."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or []]
    consumer.assign(partitions)
    consumer.seek_to_beginning()
    ends = consumer.end_offsets(partitions)
    records: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(
        consumer.position(tp) < end for tp, end in ends.items()
    ):
        for batch in consumer.poll(timeout_ms=200).values():
            records += batch
    consumer.close()
    return records


def committed_offsets(bootstrap: str, group: str, topic: str) -> dict[int, int | None]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    partitions = consumer.partitions_for_topic(topic) or set()
    result = {p: consumer.committed(TopicPartition(topic, p)) for p in sorted(partitions)}
    consumer.close(autocommit=False)
    return result


def expected_rows(topic: str, counts: dict[int, int]) -> set[tuple[str, int, int]]:
    return {(topic, p, o) for p, n in counts.items() for o in range(n)}


# --------------------------------------------------------------------------- synthetic outputs


def write_segment(
    output: Path,
    topic: str,
    partition: int,
    first: int,
    last: int,
    offsets: Iterable[int] | None = None,
    *,
    records: int | None = None,
    start: str | None = None,
    legacy: bool = False,
    dead_letters: Any = None,
) -> Path:
    """A segment as workers write it: rows at `offsets` (default: every offset of the range).

    New names hold the first offset and the range is in `segment.*` footer
    metadata; legacy names (`legacy=True`) hold first and last and no metadata.
    """
    import pyarrow as pa

    from pipeline.core.layout import SegmentKey, vectors_dir
    from sinks.segments import segment_metadata

    rows = list(range(first, last + 1)) if offsets is None else list(offsets)
    table = pa.table(
        {
            "topic": pa.array([topic] * len(rows), pa.string()),
            "partition": pa.array([partition] * len(rows), pa.int32()),
            "offset": pa.array(rows, pa.int64()),
            "text": pa.array([f"r{o}" for o in rows], pa.string()),
        }
    )
    directory = vectors_dir(output)
    directory.mkdir(parents=True, exist_ok=True)
    if legacy:
        path = directory / f"{topic}-p{partition:05d}-{first:020d}-{last:020d}.parquet"
    else:
        count = len(rows) if records is None else records
        meta = segment_metadata(first, last, count, "tests", start, dead_letters)
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta})
        path = directory / SegmentKey(topic, partition, first).filename
    pq.write_table(table, path)
    return path


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


@contextlib.contextmanager
def topic_factory(broker: str) -> Iterator[Callable[..., str]]:
    """Creates fresh uniquely named topics; deletes them (and their .dlq) on exit."""
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=broker, client_id="tests")
    created: list[str] = []

    def create(partitions: int = 1, prefix: str = "t") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        admin.create_topics([NewTopic(name, partitions, 1)])
        created.append(name)
        return name

    try:
        yield create
        existing = set(admin.list_topics())
        doomed = [t for t in created + [f"{t}.dlq" for t in created] if t in existing]
        if doomed:
            admin.delete_topics(doomed)
    finally:
        admin.close()
