"""The private parts of kafka-python the pipeline touches (pipeline.kafka.internals)
are there in the installed release: a release that lacks one fails here, never
silently in a running worker."""

from __future__ import annotations

from types import SimpleNamespace

import kafka
from kafka import KafkaConsumer

from pipeline.kafka import internals, record_batches


def test_the_pinned_release_has_every_internal_the_pipeline_touches() -> None:
    assert kafka.__version__ == record_batches.MIRRORED_RELEASE
    # No broker is contacted until a poll: the client's parts exist from the start.
    consumer = KafkaConsumer(bootstrap_servers="127.0.0.1:1", api_version=(3, 0))
    try:
        assert internals.missing(consumer) == []
        assert internals.heard_by_group(consumer)  # never joined: nothing expired
        assert internals.rejoining(consumer) is False  # not subscribed: no group to join
    finally:
        consumer.close(autocommit=False, timeout_ms=100)


def test_a_client_without_them_is_named_and_done_without(caplog) -> None:
    other = SimpleNamespace(_coordinator=SimpleNamespace(), _fetcher=SimpleNamespace())
    assert internals.missing(other) == [
        "_coordinator.heartbeat.session_timeout_expired",
        "_coordinator.need_rejoin",
        "_fetcher._paused_partition_records",
        "_fetcher._next_partition_records",
        "_fetcher.PartitionRecords",
    ]
    internals.check(other)
    assert sum("the worker does without it" in r.getMessage() for r in caplog.records) == 5
    assert internals.heard_by_group(other)
    assert not internals.rejoining(other)
    assert not internals.unpark_resumed(other)
