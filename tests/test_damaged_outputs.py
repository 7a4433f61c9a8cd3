"""Damaged outputs and wrong starts: truncated segments, another host's temp
files, a fresh output directory for a group that already consumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import kafka.errors as kerrors
import pyarrow.parquet as pq
import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.structs import OffsetAndMetadata

from consumers import repair
from pipeline.core.config import KafkaSettings
from pipeline.core.errors import IndexStateError, OutputError, PipelineError
from pipeline.core.layout import quarantine_dir, segments_by_partition, vectors_dir
from sinks.writers import STALE_TEMP_AGE_S
from tests.helpers import (
    PIPELINE,
    REPO,
    committed_offsets,
    corpus_records,
    duplicates,
    index_rows,
    output_rows,
    publish_json,
    publish_with_keys_not_utf8,
    run_until_end,
    start_worker,
    stop,
    worker_env,
)

pytestmark = pytest.mark.integration


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def every_offset_once(output: Path, topic: str, counts: dict[int, int]) -> None:
    rows = output_rows(output)
    assert duplicates(rows) == []
    assert set(rows) == {(topic, p, o) for p, n in counts.items() for o in range(n)}
    assert sorted(index_rows(output)) == sorted(rows)


def test_truncated_segments_are_moved_aside_and_read_again(
    broker, make_topic, group_id, tmp_path, tiny_model
):
    topic = make_topic(partitions=2)
    # Header keys that are not UTF-8 among them: the repair reads them back.
    publish_with_keys_not_utf8(broker, topic, corpus_records(200), partitions=2)
    out = tmp_path / "out"
    options = ("--batch-size", "16", "--model", tiny_model)
    assert run_until_end(broker, topic, group_id, out, *options).returncode == 0
    segments = segments_by_partition(out)
    # Two neighbours in the middle of a partition, already indexed (a disk error,
    # a partial restore), and the last segment of the other partition.
    damaged = [s.path for s in segments[(topic, 0)][2:4]] + [segments[(topic, 1)][-1].path]
    for path in damaged:
        truncate(path)
    # A temp file another machine's writer left long ago (containers change hostname).
    stray = vectors_dir(out) / f".{damaged[0].name}.0.other_host.1.cafe.tmp"
    stray.write_bytes(b"partial")
    old = time.time() - STALE_TEMP_AGE_S - 60
    os.utime(stray, (old, old))

    result = run_until_end(broker, topic, group_id, out, *options)

    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "damaged segment" in result.stderr
    moved = sorted(p.name for p in quarantine_dir(out).iterdir() if not p.name.endswith(".json"))
    assert [name.split(".parquet")[0] for name in moved] == sorted(
        path.name.split(".parquet")[0] for path in damaged
    )
    notes = [json.loads(p.read_text()) for p in quarantine_dir(out).glob("*.json")]
    assert all(note["repaired"] for note in notes), notes
    assert not stray.exists()
    every_offset_once(out, topic, {0: 100, 1: 100})
    for path in damaged:
        pq.read_table(path)  # whole again
    assert committed_offsets(broker, group_id, topic) == {0: 100, 1: 100}


def test_index_rebuild_skips_a_damaged_segment_with_one_line(
    broker, make_topic, group_id, tmp_path, tiny_model
):
    topic = make_topic(partitions=1)
    publish_json(broker, topic, corpus_records(64), partitions=1)
    out = tmp_path / "out"
    options = ("--batch-size", "16", "--model", tiny_model)
    assert run_until_end(broker, topic, group_id, out, *options).returncode == 0
    damaged = segments_by_partition(out)[(topic, 0)][1].path
    truncate(damaged)

    rebuild = subprocess.run(
        [*PIPELINE, "index", "rebuild", "--output", str(out)],
        env=worker_env(broker),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert rebuild.returncode == IndexStateError.exit_code, rebuild.stderr
    assert "Traceback" not in rebuild.stderr
    assert damaged.name in rebuild.stderr
    assert "index rebuilt: 16 vectors" in rebuild.stdout  # the segment before it


def _commit(bootstrap: str, group: str, topic: str, offsets: dict[int, int]) -> None:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    tps = {TopicPartition(topic, p): OffsetAndMetadata(o, "", -1) for p, o in offsets.items()}
    consumer.assign(list(tps))
    consumer.commit(tps)
    consumer.close(autocommit=False)


def test_a_fresh_output_for_a_group_that_consumed_is_the_users_choice(
    broker, make_topic, group_id, tmp_path, tiny_model
):
    topic = make_topic(partitions=2)
    publish_json(broker, topic, corpus_records(60), partitions=2)
    _commit(broker, group_id, topic, {0: 20, 1: 10})
    out = tmp_path / "fresh"

    refused = run_until_end(broker, topic, group_id, out, "--model", tiny_model)

    assert refused.returncode == OutputError.exit_code, refused.stderr
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--from-committed" in errors[0] and "--group" in errors[0]
    assert f"{topic}[0]@20" in errors[0]
    assert output_rows(out) == []

    chosen = run_until_end(broker, topic, group_id, out, "--from-committed", "--model", tiny_model)

    assert chosen.returncode == 0, chosen.stderr[-3000:]
    rows = output_rows(out)
    assert duplicates(rows) == []
    assert set(rows) == {(topic, 0, o) for o in range(20, 30)} | {
        (topic, 1, o) for o in range(10, 30)
    }
    first = segments_by_partition(out)[(topic, 0)][0].path
    assert pq.read_schema(first).metadata[b"segment.start"] == b"from-committed"


def _members(bootstrap: str, group: str) -> int:
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="tests")
    try:
        return len(admin.describe_groups([group]).get(group, {}).get("members") or [])
    finally:
        admin.close()


def _wait_for(predicate, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f}s"
        time.sleep(0.3)


def test_a_damaged_last_segment_behind_the_commit_is_read_again_by_the_next_owner(
    broker, make_topic, group_id, tmp_path, tiny_model
):
    """The group committed 100; the segment holding 84..99 is damaged after the
    worker that will take the partition over has started. Its new owner must
    read 84..99 again, not only what comes after the commit."""
    topic = make_topic(partitions=1)
    publish_json(broker, topic, corpus_records(100), partitions=1)
    out = tmp_path / "out"
    options = ("--batch-size", "16", "--session-timeout-ms", "6000", "--model", tiny_model)
    first = start_worker(broker, topic, group_id, out, *options, log=tmp_path / "a.log")
    second_log = tmp_path / "b.log"
    try:
        _wait_for(lambda: committed_offsets(broker, group_id, topic) == {0: 100}, "commit 100")
        second = start_worker(broker, topic, group_id, out, *options, log=second_log)
        _wait_for(lambda: _members(broker, group_id) == 2, "the second worker in the group")
        time.sleep(2)  # past its start-up repair, owning nothing
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        truncate(segments_by_partition(out)[(topic, 0)][-1].path)
        publish_json(broker, topic, corpus_records(10, seed=1), partitions=1)
        _wait_for(lambda: committed_offsets(broker, group_id, topic) == {0: 110}, "commit 110")
        assert stop(second) == 0, second_log.read_text()[-3000:]
        assert f"assigned {topic}[0]@96;" in second_log.read_text()
    finally:
        for proc in (first, locals().get("second")):
            if proc is not None and proc.poll() is None:
                proc.kill()
    every_offset_once(out, topic, {0: 110})


class UndecodableFetch:
    """A group-less consumer whose fetches from its position meet a batch that cannot be
    decoded (a damaged batch on the broker, a codec not installed)."""

    def __init__(self, error: Exception) -> None:
        self.error, self.offset = error, 0

    def assign(self, partitions: list[TopicPartition]) -> None:
        pass

    def seek(self, partition: TopicPartition, offset: int) -> None:
        self.offset = offset

    def position(self, partition: TopicPartition, timeout_ms: int | None = None) -> int:
        return self.offset

    def poll(self, timeout_ms: int = 0) -> dict:
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        kerrors.CorruptRecordError("Record batch for partition t-2 at offset 7 failed crc check"),
        kerrors.UnsupportedCodecError("Libraries for zstd compression codec not found"),
    ],
)
def test_a_range_the_repair_cannot_decode_is_named_by_its_offset(error: Exception) -> None:
    """One line naming where, not 'Kafka refused the worker'."""
    reader = UndecodableFetch(error)
    with pytest.raises(PipelineError) as failed:
        repair.read_range(reader, KafkaSettings(), TopicPartition("t", 2), 7, 20)  # type: ignore[arg-type]
    message = str(failed.value)
    assert message.startswith("cannot decode the record batch of t[2] at offset 7")
    assert str(error) in message and "repair a damaged segment" in message
