"""Topics and records for the benchmarks: made fresh, published, checked, removed."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from harness import HarnessError
from pipeline.core.config import KafkaSettings
from pipeline.kafka import cluster


def new_topic(kafka: KafkaSettings, partitions: int = 1, prefix: str = "bench") -> str:
    topic = f"{prefix}-{uuid.uuid4().hex[:10]}"
    with cluster.admin_client(kafka) as admin:
        cluster.create_topic(admin, kafka, topic, partitions)
    return topic


def json_value(record: Mapping[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=False).encode()


def publish(
    kafka: KafkaSettings,
    topic: str,
    values: Iterable[bytes | Mapping[str, Any]],
    partitions: int = 1,
    keys: Iterable[bytes | None] | None = None,
    rate: float | None = None,
    check: bool = True,
    **producer: Any,
) -> list[float]:
    """Publishes values (dicts as JSON) round-robin over the partitions, acked by all;
    at `rate` records/s when given. Returns each record's send time, and
    checks (`check`) that the topic then holds every record it had before and these.
    Send times are wall-clock (time.time()), as the output watchers see files appear."""
    from kafka import KafkaProducer

    before = end_total(kafka, topic) if check else 0
    settings = {"acks": "all", "linger_ms": 0 if rate else 20, **producer}
    sender = KafkaProducer(**settings, **kafka.client_kwargs())
    sent_at: list[float] = []
    started = time.monotonic()
    futures = []
    try:
        key_iter = iter(keys) if keys is not None else None
        for n, value in enumerate(values):
            if rate:
                pause = started + n / rate - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
            raw = value if isinstance(value, bytes | bytearray) else json_value(value)
            key = next(key_iter) if key_iter is not None else None
            sent_at.append(time.time())
            futures.append(sender.send(topic, raw, key=key, partition=n % partitions))
        sender.flush(timeout=120)
        for future in futures:
            future.get(timeout=30)
    finally:
        sender.close(timeout=30)
    if check and end_total(kafka, topic) != before + len(sent_at):
        raise HarnessError(f"topic {topic} does not hold the {len(sent_at)} records published")
    return sent_at


def end_total(kafka: KafkaSettings, topic: str) -> int:
    with cluster.admin_client(kafka) as admin:
        partitions = cluster.partitions_of(admin, kafka, [topic])
    with cluster.offsets_consumer(kafka) as consumer:
        return sum(cluster.end_offsets(consumer, kafka, partitions).values())


def delete(kafka: KafkaSettings, topics: list[str], groups: list[str]) -> None:
    """Best effort: the run's topics and groups go, whatever failed before."""
    try:
        with cluster.admin_client(kafka) as admin:
            existing = set(admin.list_topics())
            doomed = [t for t in topics if t in existing]
            if doomed:
                admin.delete_topics(doomed)
            if groups:
                admin.delete_groups(groups)
    except Exception as exc:  # cleaning up must not hide the results
        print(f"cleanup of topics {topics} / groups {groups} failed: {exc}")
