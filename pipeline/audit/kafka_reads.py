"""What the audit reads from Kafka: the dead-letter topic and the gaps of the output."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import kafka.errors as kerrors
import numpy as np
from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord

from pipeline.audit.accounting import Scan
from pipeline.audit.ranges import EMPTY, Key, Range, merge, within
from pipeline.core.config import KafkaSettings
from pipeline.core.errors import BrokerUnavailable, PipelineError
from pipeline.kafka import cluster

# Gaps closer than this are read in one window: reading a few hundred accounted
# records costs less than a seek and a fetch round trip each. A transactional
# topic has a one-offset gap (its marker) after every transaction.
MERGE_WITHIN = 256
# A read that makes no progress for this long means the cluster stopped answering.
STALL_S = 30.0
_POLL_MS = 500
_POSITION_TIMEOUT_MS = 5_000


@dataclass
class DeadLetters:
    topic: str
    exists: bool
    offsets: dict[Key, np.ndarray] = field(default_factory=dict)  # sorted, repeats kept
    records: int = 0
    without_source: int = 0

    def of(self, key: Key) -> np.ndarray:
        return self.offsets.get(key, EMPTY)


def read_dead_letters(
    consumer: KafkaConsumer,
    kafka: KafkaSettings,
    topic: str,
    partitions: Sequence[int] | None,
    wanted: Iterable[str],
    stall_s: float = STALL_S,
) -> DeadLetters:
    """Every dead letter's source position, for the wanted source topics."""
    if partitions is None:
        return DeadLetters(topic, exists=False)
    tps = [TopicPartition(topic, p) for p in partitions]
    starts = cluster.beginning_offsets(consumer, kafka, tps)
    ends = cluster.end_offsets(consumer, kafka, tps)
    wanted_topics = set(wanted)
    found: dict[Key, list[int]] = defaultdict(list)
    dead = DeadLetters(topic, exists=True)
    for tp in tps:
        if ends[tp] <= starts[tp]:
            continue
        consumer.assign([tp])
        consumer.seek(tp, starts[tp])
        for batch in _read_until(consumer, tp, ends[tp], stall_s, f"reading {topic}"):
            for record in batch:
                dead.records += 1
                source = _source_of(record)
                if source is None:
                    dead.without_source += 1
                elif source[0] in wanted_topics:
                    found[(source[0], source[1])].append(source[2])
    dead.offsets = {k: np.sort(np.array(v, dtype=np.int64)) for k, v in found.items()}
    return dead


def _source_of(record: ConsumerRecord) -> tuple[str, int, int] | None:
    headers = dict(record.headers or [])
    try:
        return (
            headers["source.topic"].decode(),
            int(headers["source.partition"]),
            int(headers["source.offset"]),
        )
    except (KeyError, ValueError, AttributeError, UnicodeDecodeError):
        return None


def kafka_scan(consumer: KafkaConsumer, kafka: KafkaSettings, stall_s: float = STALL_S) -> Scan:
    """A Scan that reads the ranges with `consumer` (read_committed, group-less)."""

    def scan(key: Key, ranges: Sequence[Range]) -> tuple[np.ndarray, int]:
        tp = TopicPartition(*key)
        consumer.assign([tp])
        found: list[np.ndarray] = []
        reached: int | None = None
        for first, last in merge(ranges, within=MERGE_WITHIN):
            what = f"reading {key[0]}[{key[1]}] offsets {first}-{last}"
            # Every record from the last seek up to `reached` was already looked at
            # (against all the ranges), so a window that starts below it needs no seek.
            if reached is None or reached < first:
                consumer.seek(tp, first)
            for batch in _read_until(consumer, tp, last + 1, stall_s, what):
                offsets = np.fromiter((r.offset for r in batch), dtype=np.int64, count=len(batch))
                found.append(offsets[within(offsets, ranges)])
            reached = _position(consumer, tp, what)
        start_after = cluster.beginning_offsets(consumer, kafka, [tp])[tp]
        return (np.concatenate(found) if found else EMPTY), start_after

    return scan


def _read_until(
    consumer: KafkaConsumer, tp: TopicPartition, end: int, stall_s: float, what: str
) -> Iterator[list[ConsumerRecord]]:
    """Polls the one assigned partition from its position until the position reaches `end`.

    Records past `end` may come with the last batch; callers filter. With
    read_committed, the position also moves past markers and aborted records,
    which is how a range without records ends.
    """
    position = _position(consumer, tp, what)
    progress_at = time.monotonic()
    while position is None or position < end:
        try:
            records = consumer.poll(timeout_ms=_POLL_MS).get(tp, [])
        except kerrors.KafkaError as exc:
            if not cluster.is_retriable(exc):
                raise PipelineError(f"{what}: Kafka failed at offset {position} ({exc})") from exc
            records = []
        if records:
            yield records
        now = _position(consumer, tp, what)
        if records or (now is not None and (position is None or now > position)):
            progress_at = time.monotonic()
        elif time.monotonic() - progress_at > stall_s:
            raise BrokerUnavailable(
                f"{what}: no progress past offset {position} for {stall_s:.0f}s; "
                "check that the brokers are up"
            )
        position = now


def _position(consumer: KafkaConsumer, tp: TopicPartition, what: str) -> int | None:
    try:
        return consumer.position(tp, timeout_ms=_POSITION_TIMEOUT_MS)
    except kerrors.KafkaError as exc:
        if not cluster.is_retriable(exc):
            raise PipelineError(f"{what}: {exc}") from exc
        return None  # not known yet (a reset in progress): counts as no progress
