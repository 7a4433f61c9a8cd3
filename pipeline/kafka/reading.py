"""Reading one partition from a position up to an offset, with a stall deadline.

The audit (its gaps, the dead-letter topic) and the worker's dead-letter ledger
(what earlier owners of a partition dead-lettered) both read a known range of a
partition with a group-less consumer; this is that read, once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import kafka.errors as kerrors
from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord

from pipeline.core.errors import BrokerUnavailable, PipelineError
from pipeline.kafka import cluster

# A read that makes no progress for this long means the cluster stopped answering.
STALL_S = 30.0
_POLL_MS = 500
_POSITION_TIMEOUT_MS = 5_000


def read_until(
    consumer: KafkaConsumer, tp: TopicPartition, end: int, stall_s: float, what: str
) -> Iterator[list[ConsumerRecord]]:
    """Polls the one assigned partition from its position until the position reaches `end`.

    Records past `end` may come with the last batch; callers filter. With
    read_committed, the position also moves past markers and aborted records,
    which is how a range without records ends.
    """
    at = position(consumer, tp, what)
    progress_at = time.monotonic()
    while at is None or at < end:
        try:
            records = consumer.poll(timeout_ms=_POLL_MS).get(tp, [])
        except kerrors.KafkaError as exc:
            if not cluster.is_retriable(exc):
                raise PipelineError(f"{what}: Kafka failed at offset {at} ({exc})") from exc
            records = []
        if records:
            yield records
        now = position(consumer, tp, what)
        if records or (now is not None and (at is None or now > at)):
            progress_at = time.monotonic()
        elif time.monotonic() - progress_at > stall_s:
            raise BrokerUnavailable(
                f"{what}: no progress past offset {at} for {stall_s:.0f}s; "
                "check that the brokers are up"
            )
        at = now


def position(consumer: KafkaConsumer, tp: TopicPartition, what: str) -> int | None:
    """The consumer's position on `tp`; None while it is not known yet (a reset in progress)."""
    try:
        return consumer.position(tp, timeout_ms=_POSITION_TIMEOUT_MS)
    except kerrors.KafkaError as exc:
        if not cluster.is_retriable(exc):
            raise PipelineError(f"{what}: {exc}") from exc
        return None  # counts as no progress
