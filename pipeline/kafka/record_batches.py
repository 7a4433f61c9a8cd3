"""Fetched record batches decoded a batch at a time, for the worker's consumer.

kafka-python decodes a v2 record batch one record at a time through a
`DefaultRecord` object, six `decode_varint` calls and a per-record CRC, size and
deserializer step before it builds the `ConsumerRecord` the caller gets: most of
the poll thread's time with a small model. This module decodes a batch's records
in one loop (one-byte and two-byte varints inline), about twice as fast
(docs/performance.md), and yields the same `ConsumerRecord` tuples.

One difference on purpose: a header key that is not UTF-8 (Go clients and
librdkafka's C API can write one) is decoded with U+FFFD for the bad bytes, as
the Java client decodes it, where kafka-python fails the whole batch: the worker
would stop at that record at every restart, though it never reads headers.

Everything around the records stays kafka-python's: fetch sessions, positions,
CRC of each batch, aborted transactions and control batches (that logic is
`_unpack_records` below, kafka-python's own with the v2 record loop swapped),
legacy v0/v1 message sets (left to kafka-python's loop). The CRC is the same C
crc32c, called without giving up the GIL (`_crc_holds`). Because that copy and
the decoder mirror kafka-python's private code, they are used only with the
exact kafka-python code they were checked against (`_KNOWN_SOURCES`): pyproject
pins that release and its tests fail on any other; a worker on another refuses to
start, in one line, unless `PIPELINE_RECORD_DECODER=kafka-python` asks for
kafka-python's own decoder (`=batch`: the same as the default, `auto`).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
from collections.abc import Iterator
from typing import Any

import kafka
import kafka.errors as kerrors
from kafka.consumer.fetcher import ConsumerRecord, Fetcher
from kafka.protocol.consumer import IsolationLevel
from kafka.record.default_records import DefaultRecordBatch
from kafka.record.util import decode_varint

from pipeline.core.errors import ConfigError, PipelineError, SetupError

try:
    from crc32c import crc32c as _crc32c

    _crc32c(b"", gil_release_mode=0)  # crc32c before 2.4 has no such argument
except (ImportError, TypeError):  # kafka-python's own CRC then
    _crc32c = None

log = logging.getLogger(__name__)

DECODER_ENV = "PIPELINE_RECORD_DECODER"
DECODERS = ("auto", "batch", "kafka-python")

# What a fetch raises at a record batch that cannot be decoded (damaged, or compressed
# with a codec whose library is missing).
UNDECODABLE = (kerrors.UnsupportedCodecError, kerrors.CorruptRecordError)

MIRRORED_RELEASE = "3.0.12"
# sha256 of the kafka-python code this module mirrors, as MIRRORED_RELEASE ships it.
_KNOWN_SOURCES = {
    "Fetcher.PartitionRecords": "cf2214c6a21884be2beeaa15584826a2da7ee4815f75185c11c219b0b5957a76",
    "DefaultRecordBatch": "a93fc914b6cf23664b6aa8c88546101fe28db652bfb5eec16a1d1be8d323fc91",
    "decode_varint": "15359185a92694d1fc2f1d1d7b19b6670620a2146d33de4d42098f311b72d804",
}
_KNOWN_FIELDS = (
    "topic",
    "partition",
    "leader_epoch",
    "offset",
    "timestamp",
    "timestamp_type",
    "key",
    "value",
    "headers",
    "checksum",
    "serialized_key_size",
    "serialized_value_size",
    "serialized_header_size",
)


@functools.cache
def source_digests() -> dict[str, str]:
    """The digests of the kafka-python code this module mirrors, as installed."""
    parts = {
        "Fetcher.PartitionRecords": Fetcher.PartitionRecords,
        "DefaultRecordBatch": DefaultRecordBatch,
        "decode_varint": decode_varint,
    }
    return {
        name: hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()
        for name, obj in parts.items()
    }


def mirrors_installed_kafka_python() -> bool:
    try:
        digests = source_digests()
    except (OSError, TypeError):  # no source files shipped: cannot tell
        return False
    return digests == _KNOWN_SOURCES and tuple(ConsumerRecord._fields) == _KNOWN_FIELDS


def install(consumer: kafka.KafkaConsumer) -> bool:
    """Decode this consumer's fetched batches here. A kafka-python that is not the
    one mirrored is refused (SetupError) unless PIPELINE_RECORD_DECODER=kafka-python
    asks for kafka-python's own decoder; False where that, or deserializers, keep it."""
    choice = os.environ.get(DECODER_ENV, "auto").strip().lower() or "auto"
    if choice not in DECODERS:
        raise ConfigError(f"{DECODER_ENV}={choice!r}: expected one of {', '.join(DECODERS)}")
    if choice == "kafka-python":
        return False
    if not mirrors_installed_kafka_python():
        raise SetupError(
            f"kafka-python {kafka.__version__} is not the release the batch decoder "
            f"mirrors ({MIRRORED_RELEASE}): install kafka-python=={MIRRORED_RELEASE}, or set "
            f"{DECODER_ENV}=kafka-python to decode with kafka-python's own (slower)"
        )
    fetcher = getattr(consumer, "_fetcher", None)
    config = getattr(fetcher, "config", {})
    if fetcher is None or config.get("key_deserializer") or config.get("value_deserializer"):
        if choice == "batch":
            raise ConfigError(f"{DECODER_ENV}=batch: this consumer has deserializers set")
        _announce(
            logging.WARNING,
            "record decoding: kafka-python's own (deserializers are set; a header key "
            "that is not UTF-8 then stops the worker at its record)",
        )
        return False
    fetcher.PartitionRecords = BatchDecodedRecords
    _announce(
        logging.INFO, f"record decoding: a batch at a time (kafka-python {kafka.__version__})"
    )
    return True


def undecodable(where: str, exc: Exception) -> PipelineError:
    """The one line a worker stops with at a record batch it cannot decode."""
    return PipelineError(
        f"cannot decode the record batch of {where}: {exc}; the worker stops there "
        "(nothing past it is committed)"
    )


@functools.cache
def _announce(level: int, message: str) -> None:
    """Logs the decoder once a process: audits and repairs install it on consumers of their own."""
    log.log(level, message)


def _varint(buffer: bytes, pos: int) -> tuple[int, int]:
    """A zigzag varint at `pos`: one and two bytes inline, longer ones by
    kafka-python's decoder (same values, same errors)."""
    first = buffer[pos]
    if first < 0x80:
        return (first >> 1) ^ -(first & 1), pos + 1
    second = buffer[pos + 1]
    if second < 0x80:
        raw = (first & 0x7F) | (second << 7)
        return (raw >> 1) ^ -(raw & 1), pos + 2
    return decode_varint(buffer, pos)


def decode_batch(
    batch: DefaultRecordBatch, topic: str, partition: int, leader_epoch: int
) -> tuple[list[ConsumerRecord], int, Exception | None]:
    """A v2 batch's records as kafka-python would yield them, the bytes they
    took, and the error that stopped decoding (records before it are kept, as
    kafka-python yields them before raising)."""
    batch._maybe_uncompress()
    buffer = bytes(batch._buffer)  # bytes slices are bytes: no copy per field
    pos = batch._pos
    start = pos
    base_offset = batch.base_offset
    timestamp_type = batch.timestamp_type
    log_append = timestamp_type == DefaultRecordBatch.LOG_APPEND_TIME
    first_timestamp = batch.max_timestamp if log_append else batch.first_timestamp
    records: list[ConsumerRecord] = []
    append = records.append
    make = tuple.__new__
    varint = _varint
    try:
        for _ in range(batch._num_records):
            length, pos = varint(buffer, pos)
            record_start = pos
            if buffer[pos] < 0x80:  # attributes: unused, normally one zero byte
                pos += 1
            else:
                _, pos = decode_varint(buffer, pos)
            delta, pos = varint(buffer, pos)
            timestamp = first_timestamp if log_append else first_timestamp + delta
            offset_delta, pos = varint(buffer, pos)
            key_size, pos = varint(buffer, pos)
            if key_size >= 0:
                key = buffer[pos : pos + key_size]
                pos += key_size
            else:
                key, key_size = None, -1
            value_size, pos = varint(buffer, pos)
            if value_size >= 0:
                value = buffer[pos : pos + value_size]
                pos += value_size
            else:
                value, value_size = None, -1
            if buffer[pos] == 0:
                pos += 1
                headers: list[tuple[str, bytes | None]] = []
                header_size = -1
            else:
                headers, pos = _headers(buffer, pos)
                header_size = sum(
                    len(name.encode("utf-8")) + (len(data) if data is not None else 0)
                    for name, data in headers
                )
            if pos - record_start != length:
                raise kerrors.CorruptRecordError(
                    f"Invalid record size: expected to read {length} bytes in record "
                    f"payload, but instead read {pos - record_start}"
                )
            append(
                make(
                    ConsumerRecord,
                    (
                        topic,
                        partition,
                        leader_epoch,
                        base_offset + offset_delta,
                        timestamp,
                        timestamp_type,
                        key,
                        value,
                        headers,
                        None,
                        key_size,
                        value_size,
                        header_size,
                    ),
                )
            )
        if pos != len(buffer):
            raise kerrors.CorruptRecordError(
                f"{len(buffer) - pos} unconsumed bytes after all records consumed"
            )
    except kerrors.CorruptRecordError as exc:
        return records, pos - start, exc
    except (ValueError, IndexError) as exc:
        error = kerrors.CorruptRecordError(f"Found invalid record structure: {exc!r}")
        return records, pos - start, error
    return records, pos - start, None


def _headers(buffer: bytes, pos: int) -> tuple[list[tuple[str, bytes | None]], int]:
    count, pos = decode_varint(buffer, pos)
    if count < 0:
        raise kerrors.CorruptRecordError(f"Found invalid number of record headers {count}")
    headers: list[tuple[str, bytes | None]] = []
    for _ in range(count):
        name_size, pos = decode_varint(buffer, pos)
        if name_size < 0:
            raise kerrors.CorruptRecordError(f"Invalid negative header key size {name_size}")
        name = buffer[pos : pos + name_size].decode("utf-8", "replace")
        pos += name_size
        data_size, pos = decode_varint(buffer, pos)
        if data_size >= 0:
            data: bytes | None = buffer[pos : pos + data_size]
            pos += data_size
        else:
            data = None
        headers.append((name, data))
    return headers, pos


def _crc_holds(batch: Any) -> bool:
    """`DefaultRecordBatch.validate_crc` holding the GIL: over a fetch's batch the C
    CRC takes microseconds, while the GIL it gives up by default (past 32 KiB) came
    back only after the other threads' switch intervals (milliseconds)."""
    if batch.magic != 2 or _crc32c is None:
        return bool(batch.validate_crc())
    data = memoryview(batch._buffer)[batch.ATTRIBUTES_OFFSET :]
    return bool(batch.crc == _crc32c(data, gil_release_mode=0))


class BatchDecodedRecords(Fetcher.PartitionRecords):  # type: ignore[misc]
    """kafka-python's PartitionRecords with v2 batches decoded by `decode_batch`."""

    def _unpack_records(
        self, tp: Any, records: Any, key_deserializer: Any, value_deserializer: Any
    ) -> Iterator[ConsumerRecord]:
        # kafka-python 3.0.12's own method, but for the v2 record loop (marked).
        try:
            batch = records.next_batch()
            last_batch = None
            while batch is not None:
                last_batch = batch

                if self.check_crcs and not _crc_holds(batch):
                    raise kerrors.CorruptRecordError(
                        f"Record batch for partition {self.topic_partition} at offset "
                        f"{batch.base_offset} failed crc check"
                    )

                if batch.magic == 2:
                    self.leader_epoch = batch.leader_epoch
                    if (
                        self.isolation_level == IsolationLevel.READ_COMMITTED
                        and batch.has_producer_id()
                    ):
                        self._consume_aborted_transactions_up_to(batch.last_offset)

                        producer_id = batch.producer_id
                        if self._contains_abort_marker(batch):
                            self.aborted_producer_ids.discard(producer_id)
                        elif self._is_batch_aborted(batch):
                            self.next_fetch_offset = batch.next_offset
                            batch = records.next_batch()
                            continue

                    if batch.is_control_batch:
                        self.next_fetch_offset = batch.next_offset
                        batch = records.next_batch()
                        continue

                    # --- the swapped part: the whole batch decoded at once
                    decoded, size, error = decode_batch(
                        batch, tp.topic, tp.partition, self.leader_epoch
                    )
                    self.records_read += len(decoded)
                    self.bytes_read += size
                    for record in decoded:
                        self.next_fetch_offset = record.offset + 1
                        yield record
                    if error is not None:
                        raise error
                    batch = records.next_batch()
                    continue
                    # --- end of the swapped part

                yield from self._legacy_records(tp, batch, key_deserializer, value_deserializer)
                batch = records.next_batch()
            else:
                if last_batch and last_batch.magic == 2:
                    self.next_fetch_offset = last_batch.next_offset
                self.drain()
        except StopIteration as exc:
            log.exception("StopIteration raised unpacking messageset")
            raise RuntimeError("StopIteration raised unpacking messageset") from exc

    def _legacy_records(
        self, tp: Any, batch: Any, key_deserializer: Any, value_deserializer: Any
    ) -> Iterator[ConsumerRecord]:
        """A v0/v1 message set, as kafka-python's loop reads it."""
        for record in batch:
            if self.check_crcs and not record.validate_crc():
                raise kerrors.CorruptRecordError(
                    f"Record for partition {self.topic_partition} at offset "
                    f"{record.offset} failed crc check"
                )
            key_size = len(record.key) if record.key is not None else -1
            value_size = len(record.value) if record.value is not None else -1
            key = self._deserialize(key_deserializer, tp.topic, record.headers, record.key)
            value = self._deserialize(value_deserializer, tp.topic, record.headers, record.value)
            headers = record.headers
            header_size = (
                sum(
                    len(h_key.encode("utf-8")) + (len(h_val) if h_val is not None else 0)
                    for h_key, h_val in headers
                )
                if headers
                else -1
            )
            self.records_read += 1
            self.bytes_read += record.size_in_bytes
            self.next_fetch_offset = record.offset + 1
            yield ConsumerRecord(
                tp.topic,
                tp.partition,
                self.leader_epoch,
                record.offset,
                record.timestamp,
                record.timestamp_type,
                key,
                value,
                record.headers,
                record.checksum,
                key_size,
                value_size,
                header_size,
            )
