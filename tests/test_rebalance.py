"""Exactly once under the operations that broke it: several workers starting at
once, members joining and leaving, a worker stalled past its session timeout,
rebalances before any file exists. Each test ends with an independent count of
the outputs against the topic itself (every offset exactly once), not with the
workers' own account."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition

from tests.helpers import (
    committed_offsets,
    corpus_records,
    duplicates,
    index_rows,
    log_count,
    output_rows,
    publish_json,
    run_until_end,
    start_worker,
    stop,
    wait_for_log,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FAST_GROUP = ("--session-timeout-ms", "6000", "--poll-timeout-ms", "100")


@pytest.fixture
def model(tiny_model: str) -> tuple[str, str]:
    return ("--model", tiny_model)


def partition_ends(bootstrap: str, topic: str) -> dict[int, int]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or []]
    ends = consumer.end_offsets(parts)
    consumer.close()
    return {tp.partition: end for tp, end in ends.items()}


def assert_every_offset_once(bootstrap: str, topic: str, group: str, output: Path) -> None:
    rows = output_rows(output)
    ends = partition_ends(bootstrap, topic)
    expected = {(topic, p, o) for p, end in ends.items() for o in range(end)}
    assert duplicates(rows) == [], "doubled rows"
    missing = expected - set(rows)
    assert not missing, f"{len(missing)} offsets lost, e.g. {sorted(missing)[:5]}"
    assert set(rows) == expected
    assert sorted(index_rows(output)) == sorted(rows)
    assert committed_offsets(bootstrap, group, topic) == ends


def logs(*paths: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in paths if p.exists())


def test_workers_starting_together_joining_and_leaving(
    broker, make_topic, group_id, tmp_path, model
):
    """As `docker compose up --scale worker=3` does, then a fourth joins and three leave."""
    topic = make_topic(partitions=4)
    waves = iter(range(1, 100))

    def publish_wave() -> None:  # records keep arriving through every rebalance
        publish_json(broker, topic, corpus_records(600, seed=next(waves)), partitions=4)

    publish_wave()
    out = tmp_path / "out"
    options = ("--batch-size", "48", *FAST_GROUP, *model)
    names = [tmp_path / f"w{i}.log" for i in range(4)]
    workers = [start_worker(broker, topic, group_id, out, *options, log=names[i]) for i in range(3)]
    time.sleep(10)
    publish_wave()
    workers.append(start_worker(broker, topic, group_id, out, *options, log=names[3]))
    time.sleep(3)
    publish_wave()
    time.sleep(3)
    for worker in workers[:3]:
        assert stop(worker) == 0, logs(*names)
        publish_wave()
        time.sleep(1)
    assert stop(workers[3]) == 0, logs(*names)
    assert duplicates(output_rows(out)) == []

    result = run_until_end(broker, topic, group_id, out, *options, timeout=600)

    assert result.returncode == 0, result.stderr[-3000:] + logs(*names)
    assert_every_offset_once(broker, topic, group_id, out)


def test_a_rebalance_before_any_file_exists(broker, make_topic, group_id, tmp_path, model):
    """The second member joins while the first one's first batches are in flight."""
    topic = make_topic(partitions=2)
    publish_json(broker, topic, corpus_records(600), partitions=2)
    out = tmp_path / "out"
    options = ("--batch-size", "300", *FAST_GROUP, *model)
    first = start_worker(broker, topic, group_id, out, *options, log=tmp_path / "a.log")
    second = start_worker(broker, topic, group_id, out, *options, log=tmp_path / "b.log")
    time.sleep(3)
    assert stop(first) == 0
    assert stop(second) == 0

    result = run_until_end(broker, topic, group_id, out, *options, timeout=600)

    assert result.returncode == 0, result.stderr[-3000:]
    assert_every_offset_once(broker, topic, group_id, out)


def test_a_worker_stalled_past_its_session_timeout_doubles_nothing(
    broker, make_topic, group_id, tmp_path, model
):
    """SIGSTOP one of two workers past the session timeout, let records arrive, SIGCONT."""
    topic = make_topic(partitions=2)
    publish_json(broker, topic, corpus_records(400), partitions=2)
    out = tmp_path / "out"
    options = ("--batch-size", "64", *FAST_GROUP, *model)
    logs_ = (tmp_path / "a.log", tmp_path / "b.log")
    stalled = start_worker(broker, topic, group_id, out, *options, log=logs_[0])
    wait_for_log(logs_[0], "partitions joined the group", proc=stalled)
    other = start_worker(broker, topic, group_id, out, *options, log=logs_[1])
    wait_for_log(logs_[1], rf"joined the group[^:\n]*: assigned {re.escape(topic)}\[", proc=other)
    time.sleep(2)  # batches on their way in both
    stalled.send_signal(signal.SIGSTOP)
    publish_json(broker, topic, corpus_records(400, seed=1), partitions=2)
    # Evicted (6 s of session): the other worker is assigned its partition.
    taken = rf"rebalanced[^\n]*: assigned {re.escape(topic)}\["
    wait_for_log(logs_[1], taken, proc=other)
    time.sleep(2)  # the other embeds the stalled one's records meanwhile
    before = log_count(logs_[0], taken)
    stalled.send_signal(signal.SIGCONT)
    wait_for_log(logs_[0], taken, before + 1, proc=stalled)  # rejoined, a partition again
    assert stop(stalled) == 0, logs(*logs_)
    assert stop(other) == 0, logs(*logs_)
    assert duplicates(output_rows(out)) == [], logs(*logs_)

    result = run_until_end(broker, topic, group_id, out, *options, timeout=600)

    assert result.returncode == 0, result.stderr[-3000:]
    assert_every_offset_once(broker, topic, group_id, out)
