"""Dead-letter sink: bad records go to a Kafka topic with their context.

Each dead-letter record keeps the original key and value bytes unchanged and
carries six UTF-8 headers naming the failure and the source position. `send()`
returns only once the broker has acknowledged every record (acks=all, flushed),
because the committer commits past a bad record right after.

The dead letters of one source partition all go to one partition of the
dead-letter topic (`dead_letter_partition`), in source order, so that a new
owner of the source partition can read, from one partition and from a known
position on, what earlier owners already sent (`scan`): the worker's ledger
(consumers.dead_letters) sends each bad record exactly once with it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import KafkaError
from kafka.serializer import Serializer

from pipeline.core.config import KafkaSettings
from pipeline.core.errors import PipelineError
from pipeline.core.records import BadRecord
from pipeline.kafka import cluster, failures
from pipeline.kafka.reading import STALL_S, read_until

log = logging.getLogger(__name__)

SourceKey = tuple[str, int]  # (topic, partition) of the input

# The key sent for a record with neither key nor value (a tombstone without a key):
# kafka-python refuses send(key=None, value=None) before it serializes anything, so
# the key goes in as this and its serializer turns it into a null key on the wire.
_NULL_KEY = object()


class _KeyBytes(Serializer):
    """Keys are sent as the bytes they are; `_NULL_KEY` as a null key."""

    def serialize(self, topic: str, headers: list[tuple[str, bytes]], data: object) -> object:
        return None if data is _NULL_KEY else data


def _wire_key(key: bytes | None, value: bytes | None) -> object:
    """The key to hand kafka-python's send: the record's own, unless it has neither key
    nor value, which the dead-letter topic must hold as it came (null and null)."""
    return _NULL_KEY if key is None and value is None else key


def dead_letter_headers(bad: BadRecord) -> list[tuple[str, bytes]]:
    src = bad.source
    return [
        ("error.stage", bad.stage.encode()),
        ("error.class", bad.error_class.encode()),
        ("error.message", bad.message.encode("utf-8", "replace")),
        ("source.topic", src.topic.encode()),
        ("source.partition", str(src.partition).encode()),
        ("source.offset", str(src.offset).encode()),
    ]


def source_of(record: ConsumerRecord) -> tuple[str, int, int] | None:
    """(topic, partition, offset) a dead letter names in its headers; None without them."""
    headers = dict(record.headers or [])
    try:
        return (
            headers["source.topic"].decode(),
            int(headers["source.partition"]),
            int(headers["source.offset"]),
        )
    except (KeyError, ValueError, AttributeError, UnicodeDecodeError):
        return None


def dead_letter_partition(source_partition: int, partitions: int) -> int:
    """The dead-letter partition of a source partition's bad records."""
    return source_partition % partitions


@dataclass
class Scanned:
    """What one read of a dead-letter partition found."""

    partition: int
    end: int  # the partition's end offset when the read began: everything below was read
    # (source topic, partition) -> {source offset: dead-letter offset}
    found: dict[SourceKey, dict[int, int]] = field(default_factory=dict)
    read: int = 0  # dead letters read, of any source


class DeadLetterSink:
    def __init__(self, kafka: KafkaSettings, topic: str, timeout_s: float = 30.0) -> None:
        self.topic = topic
        self._timeout_s = timeout_s
        self._producer: KafkaProducer | None = None
        self._consumer: KafkaConsumer | None = None
        self._kafka = kafka
        self.sent = 0

    def _client(self) -> KafkaProducer:
        # Created on first use: most runs never see a bad record.
        if self._producer is None:
            self._producer = cluster.build_client(
                KafkaProducer,
                self._kafka,
                acks="all",
                # Sent at once: the write stage sends right after checking that the group
                # still hears this worker (consumers.dead_letters), and flushes anyway.
                linger_ms=0,
                enable_idempotence=True,
                key_serializer=_KeyBytes(),
                max_request_size=16 * 1024 * 1024,
                # Through a broker restart the producer retries on its own, as long
                # as the worker is willing to wait (--broker-timeout-s).
                delivery_timeout_ms=int(self._timeout_s * 1000),
                **cluster.client_kwargs(self._kafka),
            )
        return self._producer

    def partitions(self) -> int:
        """How many partitions the dead-letter topic has (the worker created it at start)."""
        try:
            found = self._client().partitions_for(self.topic)
        except KafkaError as exc:
            what = f"reading the partitions of dead-letter topic {self.topic}"
            raise failures.from_kafka(exc, self._kafka, what) from exc
        if not found:
            raise PipelineError(f"dead-letter topic {self.topic} has no partitions")
        return len(found)

    def send(self, records: Sequence[BadRecord], partitions: int) -> dict[int, int]:
        """Sends and flushes; returns the highest dead-letter offset written per partition."""
        if not records:
            return {}
        producer = self._client()
        try:
            futures = [
                producer.send(
                    self.topic,
                    key=_wire_key(bad.source.key, bad.source.value),
                    value=bad.source.value,
                    headers=dead_letter_headers(bad),
                    partition=dead_letter_partition(bad.source.partition, partitions),
                )
                for bad in records
            ]
            producer.flush(timeout=self._timeout_s)
            written = [future.get(timeout=self._timeout_s) for future in futures]
        except KafkaError as exc:
            what = f"writing {len(records)} record(s) to dead-letter topic {self.topic}"
            raise failures.from_kafka(exc, self._kafka, what) from exc
        self.sent += len(records)
        for bad in records:
            log.warning(
                "dead-lettered %s[%d]@%d: %s: %s",
                bad.source.topic,
                bad.source.partition,
                bad.source.offset,
                bad.error_class,
                bad.message,
            )
        highest: dict[int, int] = {}
        for meta in written:
            highest[meta.partition] = max(highest.get(meta.partition, -1), meta.offset)
        return highest

    def end_offsets(self, partitions: Collection[int]) -> dict[int, int]:
        tps = [TopicPartition(self.topic, p) for p in partitions]
        ends = cluster.end_offsets(self._reader(), self._kafka, tps, self._timeout_s)
        return {tp.partition: offset for tp, offset in ends.items()}

    def scan(self, partition: int, start: int | None, sources: Collection[SourceKey]) -> Scanned:
        """The dead letters of `sources` in one partition, from `start` (None: its first
        retained offset) up to its end now."""
        consumer = self._reader()
        tp = TopicPartition(self.topic, partition)
        begin = cluster.beginning_offsets(consumer, self._kafka, [tp], self._timeout_s)[tp]
        end = cluster.end_offsets(consumer, self._kafka, [tp], self._timeout_s)[tp]
        # Below the first retained offset nothing can be read (or doubled) any more; past
        # the end, the topic was made anew.
        first = begin if start is None or start > end else max(start, begin)
        scanned = Scanned(partition, end)
        if first >= end:
            return scanned
        wanted = set(sources)
        consumer.assign([tp])
        consumer.seek(tp, first)
        what = f"reading dead-letter topic {self.topic}[{partition}]"
        for batch in read_until(consumer, tp, end, min(STALL_S, self._timeout_s), what):
            for record in batch:
                if record.offset >= end:
                    continue
                scanned.read += 1
                source = source_of(record)
                if source is not None and source[:2] in wanted:
                    found = scanned.found.setdefault((source[0], source[1]), {})
                    found.setdefault(source[2], record.offset)
        return scanned

    def _reader(self) -> KafkaConsumer:
        if self._consumer is None:
            self._consumer = cluster.build_client(
                KafkaConsumer,
                self._kafka,
                group_id=None,
                enable_auto_commit=False,
                isolation_level="read_committed",
                fetch_max_wait_ms=100,
                **cluster.client_kwargs(self._kafka),
            )
        return self._consumer

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close(timeout=self._timeout_s)
            self._producer = None
        if self._consumer is not None:
            self._consumer.close(autocommit=False, timeout_ms=2_000)
            self._consumer = None
