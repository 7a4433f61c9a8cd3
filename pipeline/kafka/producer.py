"""`pipeline produce`: publish records from JSONL, CSV, Parquet or plain text.

Every input line becomes one JSON object value (the contract's input format); a
line that cannot be one is reported with its file and line number and either
skipped or stops the run, never dropped in silence.

Throughput (kafka-python spends ~20 us of CPU per record, so every microsecond
of ours counts): a JSONL line that already is a valid record is sent as its own
bytes, validated with `json.loads` but never re-serialised; records without a
key go round-robin to explicit partitions (cheaper than the sticky partitioner);
and delivery results are checked by sweeping the pending futures every few
thousand records instead of attaching a callback to each.
"""

from __future__ import annotations

import csv
import json
import logging
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kafka import KafkaProducer, codec
from kafka.errors import KafkaError
from kafka.future import Future

from pipeline.core.config import KafkaSettings
from pipeline.core.errors import ConfigError, PipelineError
from pipeline.core.progress import Progress
from pipeline.kafka import cluster, failures

log = logging.getLogger(__name__)

FORMATS = ("auto", "jsonl", "csv", "parquet", "text")
COMPRESSIONS = ("none", "gzip", "snappy", "lz4", "zstd")
_SUFFIXES = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".txt": "text",
    ".text": "text",
}
# Codecs kafka-python compresses with optional packages (gzip is in the stdlib).
_CODEC_PACKAGES = {
    "snappy": ("python-snappy", codec.has_snappy),
    "lz4": ("lz4", codec.has_lz4),
    "zstd": ("zstandard", codec.has_zstd),
}
# Records between two sweeps of the pending delivery futures (and progress updates).
_SWEEP_EVERY = 8192


class BadInputLine(PipelineError):
    exit_code = 8


class InputRow(NamedTuple):
    """One input record (obj) or one bad line (error), with where it came from.

    A tuple, not a dataclass: one is made per input line, and it is cheaper.
    """

    path: Path
    line: int
    obj: dict[str, Any] | None
    error: str | None = None
    # The record value as is, when the input line already is one (JSONL).
    value: bytes | None = None


@dataclass
class ProduceResult:
    sent: int = 0
    skipped: int = 0
    seconds: float = 0.0


def detect_format(path: Path, declared: str) -> str:
    if declared != "auto":
        return declared
    fmt = _SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"cannot tell the format of {path}; pass --format jsonl|csv|parquet|text")
    return fmt


def read_rows(path: Path, fmt: str, text_field: str) -> Iterator[InputRow]:
    if not path.exists():
        raise ConfigError(f"input file {path} does not exist")
    readers = {"jsonl": _jsonl, "csv": _csv, "parquet": _parquet, "text": _text}
    yield from readers[fmt](path, text_field)


def _jsonl(path: Path, text_field: str) -> Iterator[InputRow]:
    loads = json.loads
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield InputRow(path, n, None, f"not UTF-8: {exc}")
                continue
            try:
                obj = loads(line)
            except json.JSONDecodeError as exc:
                if line.strip():  # a blank line is no record, not a bad one
                    yield InputRow(path, n, None, f"invalid JSON: {exc}")
                continue
            except RecursionError:
                yield InputRow(path, n, None, "JSON nested too deeply (about 1,000 levels)")
                continue
            except ValueError as exc:  # an integer over Python's 4,300-digit limit
                yield InputRow(path, n, None, f"unreadable JSON number: {exc}")
                continue
            problem = record_problem(obj, text_field)
            if problem is None:
                yield InputRow(path, n, obj, None, raw.strip())
            else:
                yield InputRow(path, n, None, problem)


def _decoded_lines(path: Path) -> Iterator[tuple[int, str, str | None]]:
    """Lines decoded one by one, so one bad byte costs one line, not the file."""
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            try:
                yield n, raw.decode("utf-8"), None
            except UnicodeDecodeError as exc:
                yield n, "", f"not UTF-8: {exc}"


def _csv(path: Path, text_field: str) -> Iterator[InputRow]:
    with open(path, encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames is None or text_field not in reader.fieldnames:
            raise BadInputLine(f"{path}: the CSV header has no {text_field!r} column")
        for row in reader:
            if None in row:
                yield InputRow(path, reader.line_num, None, "more fields than the header")
                continue
            yield _checked(path, reader.line_num, row, text_field)


def _parquet(path: Path, text_field: str) -> Iterator[InputRow]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if text_field not in parquet.schema_arrow.names:
        raise BadInputLine(f"{path}: no {text_field!r} column")
    n = 0
    for batch in parquet.iter_batches(batch_size=8192):
        for obj in batch.to_pylist():
            n += 1
            yield _checked(path, n, obj, text_field)


def _text(path: Path, text_field: str) -> Iterator[InputRow]:
    for n, line, error in _decoded_lines(path):
        if error is not None:
            yield InputRow(path, n, None, error)
            continue
        text = line.rstrip("\r\n")
        if text.strip():
            yield InputRow(path, n, {text_field: text})


def _checked(path: Path, line: int, obj: Any, text_field: str) -> InputRow:
    problem = record_problem(obj, text_field)
    return InputRow(path, line, obj) if problem is None else InputRow(path, line, None, problem)


def record_problem(obj: Any, text_field: str) -> str | None:
    """Why obj is not a valid input record, or None when it is one."""
    if type(obj) is not dict:
        return f"not a JSON object but a {type(obj).__name__}"
    text = obj.get(text_field)
    if type(text) is not str or not text or text.isspace():
        return f"no non-empty string {text_field!r} field"
    return None


def produce(
    kafka: KafkaSettings,
    topic: str,
    files: list[Path],
    *,
    fmt: str = "auto",
    text_field: str = "text",
    key_field: str | None = None,
    compression: str = "gzip",
    skip_bad: bool = True,
    progress: bool = True,
) -> ProduceResult:
    _check_codec(compression)
    with cluster.admin_client(kafka) as admin:
        partitions = len(cluster.partitions_of(admin, kafka, [topic]))
    producer = _producer(kafka, compression)
    deliveries = Deliveries(kafka)
    publisher = Publisher(producer, topic, partitions, key_field, deliveries)
    result = ProduceResult()
    bar = Progress(f"producing to {topic}", None, enabled=progress)
    try:
        for path in files:
            rows = read_rows(path, detect_format(path, fmt), text_field)
            _publish_rows(rows, publisher, result, bar, skip_bad)
        producer.flush(timeout=60)
        deliveries.sweep()
    except KafkaError as exc:
        raise failures.from_kafka(exc, kafka, f"publishing to {topic}") from exc
    finally:
        producer.close(timeout=10)
    bar.update(result.sent)
    bar.close()
    result.seconds = bar.done / bar.rate if bar.rate else 0.0
    return result


def _publish_rows(
    rows: Iterable[InputRow],
    publisher: Publisher,
    result: ProduceResult,
    bar: Progress,
    skip_bad: bool,
) -> None:
    """The hot loop: one iteration per input line."""
    send = publisher.send
    for row in rows:
        if row.obj is None:
            _bad_line(row, skip_bad)
            result.skipped += 1
            continue
        send(row)
        result.sent += 1
        if result.sent % _SWEEP_EVERY == 0:
            bar.update(result.sent)
            publisher.deliveries.sweep()


class Deliveries:
    """Delivery results of the records sent, checked in bulk.

    A sweep over the pending futures every few thousand records costs a fraction
    of an errback attached to each record, and fails just as surely.
    """

    def __init__(self, kafka: KafkaSettings) -> None:
        self.pending: list[Future] = []
        self.failed = 0
        self.first_error: BaseException | None = None
        self._kafka = kafka

    def sweep(self) -> None:
        """Forgets acknowledged records; raises the first failure's typed error (most
        often BrokerUnavailable) if any record failed."""
        waiting = []
        for future in self.pending:
            if not future.is_done:
                waiting.append(future)
            elif future.exception is not None:
                self.failed += 1
                self.first_error = self.first_error or future.exception
        self.pending = waiting
        if self.first_error is not None:
            raise failures.from_kafka(
                self.first_error,
                self._kafka,
                f"{self.failed} record(s) were not acknowledged by {self._kafka.bootstrap_servers}",
            )


class Publisher:
    """Sends input rows: their own bytes when they have them, round-robin without a key."""

    def __init__(
        self,
        producer: KafkaProducer,
        topic: str,
        partitions: int,
        key_field: str | None,
        deliveries: Deliveries,
    ) -> None:
        self.producer = producer
        self.topic = topic
        self.partitions = partitions
        self.key_field = key_field
        self.deliveries = deliveries
        self._next = 0

    def send(self, row: InputRow) -> None:
        obj = row.obj
        assert obj is not None
        value = row.value
        if value is None:
            value = json.dumps(obj, ensure_ascii=False, default=str).encode("utf-8")
        key = obj.get(self.key_field) if self.key_field else None
        if key is None:
            # Explicit partitions skip the sticky partitioner's per-record work; the
            # batches are as large, since each partition fills its own open batch.
            partition = self._next % self.partitions
            self._next += 1
            future = self.producer.send(self.topic, value=value, partition=partition)
        else:  # the default partitioner: records with one key share a partition
            future = self.producer.send(self.topic, value=value, key=str(key).encode("utf-8"))
        self.deliveries.pending.append(future)


def _producer(kafka: KafkaSettings, compression: str) -> KafkaProducer:
    try:
        return cluster.build_client(
            KafkaProducer,
            kafka,
            acks="all",
            linger_ms=20,
            batch_size=512 * 1024,
            compression_type=None if compression == "none" else compression,
            **cluster.client_kwargs(kafka),
        )
    except (AssertionError, ValueError, RuntimeError) as exc:  # kafka-python's codec checks
        raise ConfigError(f"compression {compression} is not available here: {exc}") from exc


def _check_codec(compression: str) -> None:
    if compression not in _CODEC_PACKAGES:
        return
    package, available = _CODEC_PACKAGES[compression]
    if not available():
        raise ConfigError(
            f"--compression {compression} needs the Python package {package}, which is not "
            f"installed (pip install {package}); or use --compression gzip or none"
        )


def _bad_line(row: InputRow, skip_bad: bool) -> None:
    where = f"{row.path}:{row.line}"
    if not skip_bad:
        raise BadInputLine(f"{where}: {row.error} (use --skip-bad to skip such lines)")
    print(f"skipped {where}: {row.error}", file=sys.stderr)
