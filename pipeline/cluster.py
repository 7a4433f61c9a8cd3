"""Talking to the cluster outside the hot path: reachability, topics, offsets.

Every call is bounded by a timeout, and the failures users meet (no broker, no
such topic) become one-line `PipelineError`s.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.errors import KafkaError, TopicAlreadyExistsError

from pipeline.config import KafkaSettings
from pipeline.errors import BrokerUnavailable, PipelineError, TopicMissing

log = logging.getLogger(__name__)

BOOTSTRAP_TIMEOUT_MS = 10_000


def unreachable(kafka: KafkaSettings, exc: BaseException | None = None) -> BrokerUnavailable:
    detail = f" ({exc})" if exc else ""
    return BrokerUnavailable(
        f"no Kafka broker answered at {kafka.bootstrap_servers}{detail}; start one "
        "(scripts/dev-kafka.sh start) or set --bootstrap-servers / PIPELINE_BOOTSTRAP_SERVERS"
    )


@contextmanager
def admin_client(kafka: KafkaSettings) -> Iterator[KafkaAdminClient]:
    try:
        admin = KafkaAdminClient(bootstrap_timeout_ms=BOOTSTRAP_TIMEOUT_MS, **kafka.client_kwargs())
    except KafkaError as exc:
        raise unreachable(kafka, exc) from exc
    try:
        yield admin
    finally:
        admin.close()


@contextmanager
def offsets_consumer(kafka: KafkaSettings) -> Iterator[KafkaConsumer]:
    """A consumer outside any group, for reading offsets and timestamps."""
    try:
        consumer = KafkaConsumer(
            group_id=None,
            enable_auto_commit=False,
            bootstrap_timeout_ms=BOOTSTRAP_TIMEOUT_MS,
            **kafka.client_kwargs(),
        )
    except KafkaError as exc:
        raise unreachable(kafka, exc) from exc
    try:
        yield consumer
    finally:
        consumer.close(autocommit=False)


def partitions_of(admin: KafkaAdminClient, topics: Sequence[str]) -> list[TopicPartition]:
    """All partitions of the topics; TopicMissing names those that do not exist."""
    try:
        described = admin.describe_topics(list(topics))
    except KafkaError as exc:
        raise PipelineError(f"describing topics {', '.join(topics)} failed: {exc}") from exc
    missing = []
    partitions = []
    for topic in described:
        if topic.get("error_code", 0) != 0 or not topic.get("partitions"):
            missing.append(topic["name"])
            continue
        partitions += [
            TopicPartition(topic["name"], p["partition_index"]) for p in topic["partitions"]
        ]
    if missing:
        raise TopicMissing(
            f"topic(s) {', '.join(sorted(missing))} do not exist; create them with: "
            f"pipeline topics create TOPIC --partitions N"
        )
    return sorted(partitions)


def create_topic(
    admin: KafkaAdminClient, topic: str, partitions: int, replication: int = 1
) -> bool:
    """Creates a topic; False if it already existed with that many partitions."""
    try:
        admin.create_topics(
            {topic: {"num_partitions": partitions, "replication_factor": replication}},
            timeout_ms=30_000,
            wait_for_metadata=True,
        )
        return True
    except TopicAlreadyExistsError:
        existing = len(partitions_of(admin, [topic]))
        if existing != partitions:
            raise PipelineError(
                f"topic {topic} already exists with {existing} partitions, not {partitions}"
            ) from None
        return False
    except KafkaError as exc:
        raise PipelineError(f"creating topic {topic} failed: {exc}") from exc


def ensure_topic(admin: KafkaAdminClient, topic: str, partitions: int = 1) -> None:
    """Creates the topic when it is missing (used for the dead-letter topic)."""
    if topic not in set(admin.list_topics()):
        created = create_topic(admin, topic, partitions)
        if created:
            log.info("created topic %s (%d partition(s))", topic, partitions)


def group_offsets(admin: KafkaAdminClient, group: str) -> dict[TopicPartition, int]:
    """Committed offsets of a group (partitions without a commit are absent)."""
    try:
        result: dict[str, dict[TopicPartition, Any]] = admin.list_group_offsets({group: None})
    except KafkaError as exc:
        raise PipelineError(f"reading committed offsets of group {group} failed: {exc}") from exc
    return {tp: meta.offset for tp, meta in result.get(group, {}).items() if meta.offset >= 0}


def end_offsets(
    consumer: KafkaConsumer, partitions: Sequence[TopicPartition]
) -> dict[TopicPartition, int]:
    if not partitions:
        return {}
    try:
        return dict(consumer.end_offsets(list(partitions), timeout_ms=30_000))
    except KafkaError as exc:
        raise PipelineError(f"reading end offsets failed: {exc}") from exc
