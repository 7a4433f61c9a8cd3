"""What the audit reads from Kafka: the dead-letter topic and the gaps of the output."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from kafka import KafkaConsumer, TopicPartition

from pipeline.audit.accounting import Scan
from pipeline.audit.ranges import EMPTY, Key, Range, merge, within
from pipeline.core.config import KafkaSettings
from pipeline.kafka import cluster
from pipeline.kafka.dead_letter import source_of
from pipeline.kafka.reading import STALL_S, position, read_until

# Gaps closer than this are read in one window: reading a few hundred accounted
# records costs less than a seek and a fetch round trip each. A transactional
# topic has a one-offset gap (its marker) after every transaction.
MERGE_WITHIN = 256


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
        for batch in read_until(consumer, tp, ends[tp], stall_s, f"reading {topic}"):
            for record in batch:
                dead.records += 1
                source = source_of(record)
                if source is None:
                    dead.without_source += 1
                elif source[0] in wanted_topics:
                    found[(source[0], source[1])].append(source[2])
    dead.offsets = {k: np.sort(np.array(v, dtype=np.int64)) for k, v in found.items()}
    return dead


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
            for batch in read_until(consumer, tp, last + 1, stall_s, what):
                offsets = np.fromiter((r.offset for r in batch), dtype=np.int64, count=len(batch))
                found.append(offsets[within(offsets, ranges)])
            reached = position(consumer, tp, what)
        start_after = cluster.beginning_offsets(consumer, kafka, [tp])[tp]
        return (np.concatenate(found) if found else EMPTY), start_after

    return scan
