"""`pipeline produce`: publish records from JSONL, CSV, Parquet or plain text.

Every input line becomes one JSON object value (the contract's input format); a
line that cannot be one is reported with its file and line number and either
skipped or stops the run, never dropped in silence.
"""

from __future__ import annotations

import csv
import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafka import KafkaProducer
from kafka.errors import KafkaError

from pipeline import cluster
from pipeline.config import KafkaSettings
from pipeline.errors import BrokerUnavailable, ConfigError, PipelineError
from pipeline.progress import Progress

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


class BadInputLine(PipelineError):
    exit_code = 8


@dataclass(frozen=True)
class InputRow:
    path: Path
    line: int
    obj: dict[str, Any] | None
    error: str | None = None


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
    for n, line, error in _decoded_lines(path):
        if error is not None:
            yield InputRow(path, n, None, error)
            continue
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            yield InputRow(path, n, None, f"invalid JSON: {exc}")
            continue
        yield _checked(path, n, obj, text_field)


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
    if not isinstance(obj, dict):
        return InputRow(path, line, None, f"not a JSON object but a {type(obj).__name__}")
    text = obj.get(text_field)
    if not isinstance(text, str) or not text.strip():
        return InputRow(path, line, None, f"no non-empty string {text_field!r} field")
    return InputRow(path, line, obj)


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
    with cluster.admin_client(kafka) as admin:
        cluster.partitions_of(admin, [topic])
    producer = _producer(kafka, compression)
    result = ProduceResult()
    bar = Progress(f"producing to {topic}", None, enabled=progress)
    failures: list[BaseException] = []
    try:
        for path in files:
            for row in read_rows(path, detect_format(path, fmt), text_field):
                if row.obj is None:
                    _bad_line(row, skip_bad)
                    result.skipped += 1
                    continue
                key = row.obj.get(key_field) if key_field else None
                value = json.dumps(row.obj, ensure_ascii=False, default=str).encode("utf-8")
                producer.send(
                    topic, value=value, key=None if key is None else str(key).encode("utf-8")
                ).add_errback(failures.append)
                result.sent += 1
                if result.sent % 1000 == 0:
                    bar.update(result.sent)
                    _raise_failures(failures, kafka)
        producer.flush(timeout=60)
        _raise_failures(failures, kafka)
    except KafkaError as exc:
        raise BrokerUnavailable(f"publishing to {topic} failed: {exc}") from exc
    finally:
        producer.close(timeout=10)
    bar.update(result.sent)
    bar.close()
    result.seconds = bar.done / bar.rate if bar.rate else 0.0
    return result


def _producer(kafka: KafkaSettings, compression: str) -> KafkaProducer:
    try:
        return KafkaProducer(
            acks="all",
            linger_ms=20,
            batch_size=512 * 1024,
            compression_type=None if compression == "none" else compression,
            bootstrap_timeout_ms=cluster.BOOTSTRAP_TIMEOUT_MS,
            **kafka.client_kwargs(),
        )
    except KafkaError as exc:
        raise cluster.unreachable(kafka, exc) from exc
    except (AssertionError, ValueError) as exc:  # kafka-python's check for codec libraries
        raise ConfigError(f"compression {compression} is not available here: {exc}") from exc


def _bad_line(row: InputRow, skip_bad: bool) -> None:
    where = f"{row.path}:{row.line}"
    if not skip_bad:
        raise BadInputLine(f"{where}: {row.error} (use --skip-bad to skip such lines)")
    print(f"skipped {where}: {row.error}", file=sys.stderr)


def _raise_failures(failures: list[BaseException], kafka: KafkaSettings) -> None:
    if failures:
        raise BrokerUnavailable(
            f"{len(failures)} record(s) were not acknowledged by {kafka.bootstrap_servers}: "
            f"{failures[0]}"
        )
