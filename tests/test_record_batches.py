"""The batch decoder (pipeline.kafka.record_batches) yields what kafka-python yields: the
same ConsumerRecord tuples, positions, errors and skipped transactions, for every
batch kind a broker can return (but for header keys that are not UTF-8, which it reads
as the Java client does, and kafka-python fails on); and it is used only with the
kafka-python code it mirrors. The last test reads a real broker's topic through both decoders."""

from __future__ import annotations

import contextlib
import functools
import inspect
import random
import struct
import textwrap
from collections import namedtuple
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import kafka
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord, Fetcher
from kafka.protocol.consumer import IsolationLevel
from kafka.record import MemoryRecords, default_records
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder
from kafka.record.legacy_records import LegacyRecordBatchBuilder
from kafka.record.util import calc_crc32c

from pipeline.core.errors import ConfigError, SetupError
from pipeline.kafka import record_batches
from pipeline.kafka.record_batches import BatchDecodedRecords
from tests.helpers import NOT_UTF8_KEYS, RawHeaderKey

TP = TopicPartition("topic-a", 3)
Aborted = namedtuple("Aborted", "producer_id first_offset")
CODECS = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}
CONTROL, LOG_APPEND_TIME = 0x20, 0x08


def v2_batch(
    base_offset: int,
    records: list[tuple[int, int, bytes | None, bytes | None, list]],
    codec: str = "none",
    producer_id: int = -1,
    attributes: int = 0,
    max_timestamp: int | None = None,
) -> bytes:
    """A v2 batch of (offset delta, timestamp, key, value, headers), with header
    bits a producer cannot set (control, log-append time) patched in, CRC redone."""
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=CODECS[codec],
        is_transactional=producer_id >= 0,
        producer_id=producer_id,
        producer_epoch=0 if producer_id >= 0 else -1,
        base_sequence=0 if producer_id >= 0 else -1,
        batch_size=1 << 30,
    )
    for delta, timestamp, key, value, headers in records:
        builder.append(delta, timestamp=timestamp, key=key, value=value, headers=headers)
    data = bytearray(builder.build())
    struct.pack_into(">q", data, 0, base_offset)
    base = DefaultRecordBatch
    if attributes:
        (current,) = struct.unpack_from(">h", data, base.ATTRIBUTES_OFFSET)
        struct.pack_into(">h", data, base.ATTRIBUTES_OFFSET, current | attributes)
    if max_timestamp is not None:
        struct.pack_into(">q", data, base.ATTRIBUTES_OFFSET + 2 + 4 + 8, max_timestamp)
    struct.pack_into(">I", data, base.CRC_OFFSET, calc_crc32c(data[base.ATTRIBUTES_OFFSET :]))
    return bytes(data)


def control_batch(offset: int, producer_id: int, commit: bool) -> bytes:
    marker = (0, 0, struct.pack(">hh", 0, int(commit)), b"\x00\x00\x00\x00\x00\x00", [])
    return v2_batch(offset, [marker], producer_id=producer_id, attributes=CONTROL)


def legacy_batch(magic: int, base_offset: int, count: int, codec: str = "none") -> bytes:
    builder = LegacyRecordBatchBuilder(magic, CODECS[codec] if codec != "zstd" else 0, 1 << 30)
    for n in range(count):
        offset = base_offset + n
        builder.append(offset, 1_700_000_000_000 + n, b"k%d" % n, b"legacy %d" % offset)
    return bytes(builder.build())


def drain(cls: type, data: bytes, take: int | None = None, **kwargs: Any) -> dict[str, Any]:
    """Everything a consumer sees from one fetch: each take()'s records, the error
    that ended it (by class and message) and the positions after each take."""
    parts = cls(kwargs.pop("fetch_offset", 0), TP, MemoryRecords(data), **kwargs)
    seen: list[Any] = []
    for _ in range(10_000):
        if not parts:
            break
        try:
            got = parts.take(take)
        except Exception as exc:
            # kafka-python indexes a bytearray, the decoder bytes: same error otherwise.
            message = str(exc).replace("bytearray index", "index")
            seen.append(("error", type(exc).__name__, message))
            break
        seen.append((got, parts.next_fetch_offset))
        if not got:
            break
    return {"takes": seen, "records_read": parts.records_read, "position": parts.next_fetch_offset}


@functools.cache
def lenient_read_msg() -> Callable[..., Any]:
    """kafka-python's own record reader with the decoder's one difference on purpose: a
    header key that is not UTF-8 read with U+FFFD, as the Java client reads it."""
    source = textwrap.dedent(inspect.getsource(DefaultRecordBatch._read_msg))
    strict = 'h_key = buffer[pos: pos + h_key_len].decode("utf-8")'
    assert source.count(strict) == 1, "kafka-python reads header keys another way now"
    source = source.replace(strict, strict[:-1] + ', "replace")')
    namespace: dict[str, Any] = {}
    exec(source, vars(default_records), namespace)
    return namespace["_read_msg"]


@contextlib.contextmanager
def lenient_kafka_python() -> Iterator[None]:
    strict = DefaultRecordBatch._read_msg
    DefaultRecordBatch._read_msg = lenient_read_msg()
    try:
        yield
    finally:
        DefaultRecordBatch._read_msg = strict


def same_as_kafka_python(data: bytes, **kwargs: Any) -> dict[str, Any]:
    ours = drain(BatchDecodedRecords, data, **kwargs)
    with lenient_kafka_python():
        theirs = drain(Fetcher.PartitionRecords, data, **kwargs)
    assert ours["takes"] == theirs["takes"]
    assert ours["position"] == theirs["position"]
    return ours


def records_of(result: dict[str, Any]) -> list[ConsumerRecord]:
    return [r for take in result["takes"] if take[0] != "error" for r in take[0]]


def random_records(rng: random.Random, count: int, start_ts: int) -> list:
    out = []
    for n in range(count):
        key = None if rng.random() < 0.3 else rng.randbytes(rng.choice([0, 3, 200]))
        value = None if rng.random() < 0.05 else rng.randbytes(rng.choice([0, 1, 60, 150, 70_000]))
        headers = [
            (rng.choice(["trace", "源", "x" * 130]), None if rng.random() < 0.3 else b"v" * n)
            for _ in range(rng.choice([0, 0, 0, 1, 3]))
        ]
        timestamp = start_ts + rng.choice([0, 5, 63, 64, 8191, 8192, 10**7, -70])
        out.append((n * rng.choice([1, 1, 2, 300]), timestamp, key, value, headers))
    return out


def test_plain_batches_equal_kafka_pythons() -> None:
    data = b"".join(
        v2_batch(offset, [(n, 1_700 + n, b"k", b'{"text": "x"}', []) for n in range(50)])
        for offset in (0, 50, 100)
    )
    result = same_as_kafka_python(data)
    assert [r.offset for r in records_of(result)] == list(range(150))
    assert result["records_read"] == 150


@pytest.mark.parametrize("codec", list(CODECS))
def test_random_batches_equal_kafka_pythons(codec: str) -> None:
    rng = random.Random(codec)
    for _ in range(8):
        batches, offset = [], rng.randrange(0, 1 << 40)
        for _ in range(rng.randint(1, 5)):
            records = random_records(rng, rng.randint(1, 120), rng.randrange(0, 1 << 41))
            batches.append(v2_batch(offset, records, codec))
            offset += records[-1][0] + 1 + rng.choice([0, 0, 5])  # compacted gaps
        data = b"".join(batches)
        assert records_of(same_as_kafka_python(data))
        assert records_of(same_as_kafka_python(data, take=7))


def test_values_keys_headers_and_sizes() -> None:
    records = [
        (0, 10, None, None, []),
        (1, 11, b"", b"", []),
        (2, 12, b"key", b"v" * 300, [("h1", b"a"), ("源", None), ("", b"")]),
    ]
    got = records_of(same_as_kafka_python(v2_batch(40, records)))
    assert [(r.offset, r.key, r.value) for r in got] == [
        (40, None, None),
        (41, b"", b""),
        (42, b"key", b"v" * 300),
    ]
    assert got[2].headers == [("h1", b"a"), ("源", None), ("", b"")]
    assert (got[0].serialized_key_size, got[0].serialized_value_size) == (-1, -1)
    assert got[2].serialized_header_size == (2 + 1) + 3 + 0  # "源" is 3 bytes of UTF-8
    assert all(isinstance(r.value, bytes) for r in got if r.value is not None)


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_header_keys_that_are_not_utf8_read_as_the_java_client_reads_them(codec: str) -> None:
    """kafka-python fails the whole batch on such a key, which would stop the worker at
    that record at every restart; the decoder reads it with U+FFFD and goes on."""
    records = [
        (n, 10 + n, None, b"value %d" % n, [(RawHeaderKey(raw), b"x"), ("trace", None)])
        for n, raw in enumerate(NOT_UTF8_KEYS)
    ]
    data = v2_batch(0, [*records, (9, 20, None, b"last", [])], codec)
    strict = drain(Fetcher.PartitionRecords, data, check_crcs=True)["takes"]
    assert strict[0][:2] == ("error", "CorruptRecordError") and "UnicodeDecodeError" in strict[0][2]

    got = records_of(same_as_kafka_python(data, check_crcs=True))

    assert [r.value for r in got] == [b"value 0", b"value 1", b"value 2", b"value 3", b"last"]
    keys = [r.headers[0][0] for r in got[:4]]
    assert keys == ["\ufffd\ufffd", "caf\ufffd", "\ufffd" * 3, "\ufffd"]
    assert all(r.headers[1] == ("trace", None) for r in got[:4])


def test_log_append_time_takes_the_batchs_max_timestamp() -> None:
    data = v2_batch(
        0,
        [(n, 1_000 + n, None, b"x", []) for n in range(3)],
        attributes=LOG_APPEND_TIME,
        max_timestamp=99_999,
    )
    got = records_of(same_as_kafka_python(data))
    assert {(r.timestamp, r.timestamp_type) for r in got} == {(99_999, 1)}


def test_a_fetch_from_inside_a_batch_starts_at_the_fetch_offset() -> None:
    data = v2_batch(100, [(n, 5, None, b"x", []) for n in range(20)], codec="gzip")
    got = records_of(same_as_kafka_python(data, fetch_offset=113))
    assert [r.offset for r in got] == list(range(113, 120))


def test_aborted_transactions_and_markers_as_kafka_python() -> None:
    committed, aborted, plain = 7, 9, -1
    data = b"".join(
        [
            v2_batch(0, [(n, 1, None, b"a%d" % n, []) for n in range(3)], producer_id=aborted),
            v2_batch(3, [(n, 1, None, b"c%d" % n, []) for n in range(3)], producer_id=committed),
            control_batch(6, aborted, commit=False),
            control_batch(7, committed, commit=True),
            v2_batch(8, [(0, 1, None, b"p", [])], producer_id=plain),
        ]
    )
    for level in (IsolationLevel.READ_COMMITTED, IsolationLevel.READ_UNCOMMITTED):
        result = same_as_kafka_python(
            data, isolation_level=level, aborted_transactions=[Aborted(aborted, 0)]
        )
        values = [r.value for r in records_of(result)]
        if level == IsolationLevel.READ_COMMITTED:
            assert values == [b"c0", b"c1", b"c2", b"p"]
        else:
            assert values == [b"a0", b"a1", b"a2", b"c0", b"c1", b"c2", b"p"]
        assert result["position"] == 9


@pytest.mark.parametrize(("magic", "codec"), [(0, "none"), (1, "none"), (1, "gzip")])
def test_legacy_message_sets_are_kafka_pythons(magic: int, codec: str) -> None:
    data = legacy_batch(magic, 0, 5, codec) + legacy_batch(magic, 5, 5, codec)
    got = records_of(same_as_kafka_python(data))
    assert [r.value for r in got] == [b"legacy %d" % n for n in range(10)]


def damaged(rng: random.Random) -> Iterator[bytes]:
    """v2 batches with a record region damaged past the CRC (check_crcs off, as a
    broker bug or a damaged segment would be met)."""
    records = [(n, 1_000 + n, b"k", b"value %d" % n, [("h", b"x")]) for n in range(12)]
    good = v2_batch(0, records)
    header = DefaultRecordBatch.HEADER_STRUCT.size
    for _ in range(200):
        data = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(header, len(data))] = rng.randrange(256)
        yield bytes(data)
    yield good[:-3]  # truncated inside the last record
    yield good + b"\x00\x00"  # unconsumed bytes after the last record is read


def test_damaged_records_fail_as_kafka_pythons_after_the_same_records() -> None:
    errors = 0
    for data in damaged(random.Random(5)):
        for take in (None, 4):
            result = same_as_kafka_python(data, check_crcs=False, take=take)
            errors += result["takes"][-1][0] == "error"
    assert errors > 100  # the damage reached the decoder, not just the values


def test_damaged_records_fail_the_crc_check_as_kafka_pythons() -> None:
    """With check_crcs on (the worker's setting), the same batches fail the CRC (the C
    crc32c, called holding the GIL), with the same error, after the same records."""
    failed = 0
    for data in damaged(random.Random(6)):
        result = same_as_kafka_python(data, check_crcs=True)
        last = result["takes"][-1]
        failed += last[0] == "error" and "failed crc check" in last[2]
    assert failed >= 200


def test_the_installed_kafka_python_is_the_release_mirrored() -> None:
    """pyproject pins it: another release fails here, where the comparisons above
    would have measured nothing."""
    assert kafka.__version__ == record_batches.MIRRORED_RELEASE
    assert record_batches.mirrors_installed_kafka_python()


def test_used_only_with_the_kafka_python_it_mirrors(monkeypatch: pytest.MonkeyPatch) -> None:

    def installed(**config: Any) -> bool:
        # Stands for a KafkaConsumer's parts that install() reads; the real one is
        # the integration test's below.
        made = SimpleNamespace(_fetcher=SimpleNamespace(config=config))
        used = record_batches.install(made)  # type: ignore[arg-type]
        assert (getattr(made._fetcher, "PartitionRecords", None) is BatchDecodedRecords) == used
        return used

    assert installed()
    assert not installed(value_deserializer=bytes.decode)
    monkeypatch.setenv(record_batches.DECODER_ENV, "kafka-python")
    assert not installed()
    monkeypatch.setenv(record_batches.DECODER_ENV, "fastest")
    with pytest.raises(ConfigError, match="PIPELINE_RECORD_DECODER"):
        installed()
    monkeypatch.setenv(record_batches.DECODER_ENV, "batch")  # the same as the default
    assert installed()
    # Another kafka-python: refused in one line, unless its own decoder is asked for.
    changed = dict(record_batches._KNOWN_SOURCES, DefaultRecordBatch="0" * 64)
    monkeypatch.setattr(record_batches, "_KNOWN_SOURCES", changed)
    for choice in ("batch", "auto"):
        monkeypatch.setenv(record_batches.DECODER_ENV, choice)
        with pytest.raises(SetupError, match="not the release the batch decoder mirrors"):
            installed()
    monkeypatch.setenv(record_batches.DECODER_ENV, "kafka-python")
    assert not installed()


@pytest.mark.integration
def test_a_real_topic_reads_the_same_through_both_decoders(broker: str, make_topic) -> None:
    """Records of every codec, with keys, headers and a transaction aborted, fetched
    from the broker by two read_committed consumers, one with each decoder."""
    topic = make_topic(partitions=2)
    rng = random.Random(11)
    for codec in ("gzip", "snappy", "lz4", "zstd", None):
        producer = KafkaProducer(bootstrap_servers=broker, compression_type=codec, linger_ms=5)
        for n in range(150):
            headers = [("trace", b"%d" % n), ("空", b"")] if n % 3 == 0 else []
            key = None if n % 4 == 0 else b"key-%d" % n
            text = "".join(rng.choice("ab 中文 é\n") for _ in range(rng.randint(0, 400)))
            producer.send(topic, text.encode(), key=key, headers=headers, partition=n % 2)
        producer.close(timeout=30)
    transactional = KafkaProducer(bootstrap_servers=broker, transactional_id=f"tx-{topic}")
    transactional.init_transactions()
    transactional.begin_transaction()
    transactional.send(topic, b"aborted", partition=0)
    transactional.flush()
    transactional.abort_transaction()
    transactional.begin_transaction()
    transactional.send(topic, b"committed", partition=0)
    transactional.commit_transaction()
    transactional.close(timeout=30)

    def read(decoder: bool) -> list[ConsumerRecord]:
        consumer = KafkaConsumer(
            bootstrap_servers=broker,
            group_id=None,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            max_poll_records=97,
        )
        if decoder:
            assert record_batches.install(consumer)
        consumer.assign([TopicPartition(topic, 0), TopicPartition(topic, 1)])
        seen: list[ConsumerRecord] = []
        for _ in range(200):
            polled = consumer.poll(timeout_ms=500)
            seen.extend(r for batch in polled.values() for r in batch)
            if len(seen) >= 751 and not polled:
                break
        consumer.close()
        return sorted(seen, key=lambda r: (r.partition, r.offset))

    ours, theirs = read(True), read(False)
    assert len(ours) == 751
    assert ours == theirs
    assert b"aborted" not in {r.value for r in ours} and b"committed" in {r.value for r in ours}
