"""The lag monitor: figures checked against independent reads of the real broker,
verdict logic over synthetic histories, output coverage (MISMATCH), rendering,
watch, and exit codes (verdicts 0-4, operational errors 64 and up)."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.structs import OffsetAndMetadata

from pipeline.cli import main
from pipeline.core.config import KafkaSettings
from pipeline.core.errors import BrokerUnavailable, ConfigError, PipelineError, TopicMissing
from pipeline.core.layout import vectors_dir
from pipeline.status import (
    LAGGING,
    MISMATCH,
    OK,
    STALLED,
    STOPPED,
    Point,
    StatusHistory,
    collect_status,
    commit_rate,
    drain_eta,
    exit_code_for,
    judge_partition,
    render_table,
    watch,
    worst,
)
from pipeline.status.outputs import output_facts
from tests.helpers import truncate, write_segment

# --------------------------------------------------------------------------- helpers


def produce(
    broker: str,
    topic: str,
    counts: Mapping[int, int],
    timestamp_ms: Callable[[int, int], int] | None = None,
) -> None:
    """Writes counts[p] records to partition p; timestamp_ms(partition, i) sets their time."""
    producer = KafkaProducer(bootstrap_servers=broker)
    try:
        for partition, count in counts.items():
            for i in range(count):
                ts = timestamp_ms(partition, i) if timestamp_ms else None
                value = json.dumps({"text": f"p{partition} r{i}"}).encode()
                producer.send(topic, value, partition=partition, timestamp_ms=ts)
        producer.flush(timeout=10)
    finally:
        producer.close(timeout=5)


def commit(broker: str, group: str, offsets: Mapping[tuple[str, int], int]) -> None:
    consumer = KafkaConsumer(bootstrap_servers=broker, group_id=group, enable_auto_commit=False)
    try:
        tps = {TopicPartition(t, p): off for (t, p), off in offsets.items()}
        consumer.assign(list(tps))
        consumer.commit({tp: OffsetAndMetadata(off, None, -1) for tp, off in tps.items()})
    finally:
        consumer.close(autocommit=False)


def broker_view(broker: str, group: str, topic: str, partitions: int) -> dict[int, tuple]:
    """(committed, end) per partition, read without the code under test."""
    consumer = KafkaConsumer(bootstrap_servers=broker, group_id=group, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        ends = consumer.end_offsets(tps)
        return {tp.partition: (consumer.committed(tp), ends[tp]) for tp in tps}
    finally:
        consumer.close(autocommit=False)


def by_partition(report: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    return {row["partition"]: row for row in report["partitions"]}


@pytest.fixture
def admin(broker: str) -> Iterator[KafkaAdminClient]:
    client = KafkaAdminClient(bootstrap_servers=broker, client_id="tests-status")
    yield client
    client.close()


# --------------------------------------------------------------------------- integration


@pytest.mark.integration
def test_figures_match_the_broker(broker, kafka_settings, make_topic, group_id):
    topic = make_topic(partitions=3)
    produce(broker, topic, {0: 10, 1: 11, 2: 12})
    commit(broker, group_id, {(topic, 0): 4, (topic, 1): 11})  # partition 2: nothing

    report = collect_status(kafka_settings, group_id)

    truth = broker_view(broker, group_id, topic, 3)
    assert truth == {0: (4, 10), 1: (11, 11), 2: (None, 12)}
    rows = by_partition(report)
    assert sorted(rows) == [0, 1, 2]
    for partition, (committed, end) in truth.items():
        row = rows[partition]
        assert (row["topic"], row["committed"], row["end"]) == (topic, committed, end)
        assert row["lag"] == end - (committed or 0)
    assert report["group"] == group_id
    assert report["topics"] == [topic]
    assert report["total_lag"] == 6 + 0 + 12
    # Nobody consumes: lagging partitions are STOPPED, the caught-up one OK.
    assert report["state"] in ("Empty", "Dead")
    assert report["members"] == []
    assert [rows[p]["verdict"] for p in range(3)] == [STOPPED, OK, STOPPED]
    assert report["verdict"] == STOPPED and report["exit_code"] == 3
    assert report["dead_letter"] == {"topic": f"{topic}.dlq", "records": None}
    assert report["throughput"] is None and report["eta_seconds"] is None
    json.dumps(report)  # JSON-able as it is


@pytest.mark.integration
def test_caught_up_group_is_ok(broker, kafka_settings, make_topic, group_id):
    topic = make_topic(partitions=3)
    produce(broker, topic, {0: 3, 1: 2, 2: 1})
    commit(broker, group_id, {(topic, 0): 3, (topic, 1): 2, (topic, 2): 1})

    report = collect_status(kafka_settings, group_id, topics=[topic])

    assert report["total_lag"] == 0
    assert report["verdict"] == OK and exit_code_for(report["verdict"]) == 0
    assert all(row["lag_seconds"] is None for row in report["partitions"])
    assert report["max_lag_seconds"] == 0.0


@pytest.mark.integration
def test_dead_letter_count(broker, kafka_settings, make_topic, group_id, admin):
    topic = make_topic(partitions=3)
    dlq = f"{topic}.dlq"  # make_topic's clean-up deletes it too
    admin.create_topics([NewTopic(dlq, 2, 1)])
    produce(broker, topic, {0: 1})
    produce(broker, dlq, {0: 3, 1: 2})
    commit(broker, group_id, {(topic, 0): 1})

    report = collect_status(kafka_settings, group_id)
    assert report["dead_letter"] == {"topic": dlq, "records": 5}

    named = collect_status(kafka_settings, group_id, dlq_topic=topic)
    assert named["dead_letter"] == {"topic": topic, "records": 1}


@pytest.mark.integration
def test_lag_seconds_is_the_age_of_the_oldest_unconsumed_record(
    broker, kafka_settings, make_topic, group_id
):
    topic = make_topic(partitions=3)
    start = int(time.time() * 1000)

    def stamp(partition: int, i: int) -> int:
        # Partition 0: record i is (300 - 10 i) s old; partition 1: all 120 s old.
        return start - (300_000 - 10_000 * i if partition == 0 else 120_000)

    produce(broker, topic, {0: 10, 1: 4}, timestamp_ms=stamp)
    commit(broker, group_id, {(topic, 0): 5, (topic, 1): 1})

    report = collect_status(kafka_settings, group_id)
    rows = by_partition(report)
    elapsed = time.time() - start / 1000
    # Record 5 of partition 0 is 250 s old; partition 1's are 120 s old.
    assert 250 <= rows[0]["lag_seconds"] <= 250 + elapsed + 1
    assert 120 <= rows[1]["lag_seconds"] <= 120 + elapsed + 1
    assert rows[2]["lag"] == 0 and rows[2]["lag_seconds"] is None
    assert report["max_lag_seconds"] == rows[0]["lag_seconds"]


@pytest.mark.integration
def test_named_topics_and_a_group_that_never_committed(
    broker, kafka_settings, make_topic, group_id
):
    topic = make_topic(partitions=3)
    produce(broker, topic, {0: 2, 1: 0, 2: 5})

    report = collect_status(kafka_settings, group_id, topics=[topic, topic])

    assert [(r["committed"], r["end"], r["lag"]) for r in report["partitions"]] == [
        (None, 2, 2),
        (None, 0, 0),
        (None, 5, 5),
    ]
    assert report["total_lag"] == 7 and report["verdict"] == STOPPED
    with pytest.raises(PipelineError, match="no committed offsets") as caught:
        collect_status(kafka_settings, group_id)
    assert not isinstance(caught.value, BrokerUnavailable | TopicMissing)
    assert caught.value.exit_code == 64  # a usage error, like a misspelt --group


@pytest.mark.integration
def test_missing_topic_is_topic_missing(kafka_settings, make_topic, group_id):
    topic = make_topic(partitions=1)
    with pytest.raises(TopicMissing, match=f"{topic}-nope"):
        collect_status(kafka_settings, group_id, topics=[topic, f"{topic}-nope"])


@pytest.mark.integration
def test_live_member_owns_its_partitions(broker, kafka_settings, make_topic, group_id):
    topic = make_topic(partitions=3)
    unread = make_topic(partitions=1)  # the member does not subscribe to it
    produce(broker, topic, {0: 5, 1: 5, 2: 5})
    produce(broker, unread, {0: 2})
    member = KafkaConsumer(
        topic,
        bootstrap_servers=broker,
        group_id=group_id,
        client_id="status-test-member",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    try:
        deadline = time.monotonic() + 30
        while not member.assignment() and time.monotonic() < deadline:
            member.poll(timeout_ms=200, max_records=1)
        member.commit({TopicPartition(topic, 0): OffsetAndMetadata(2, None, -1)})

        report = collect_status(kafka_settings, group_id)
        both = collect_status(kafka_settings, group_id, topics=[topic, unread])
    finally:
        member.close(autocommit=False)

    assert report["state"] == "Stable"
    [described] = report["members"]
    assert described["client_id"] == "status-test-member"
    assert described["host"] and not described["host"].startswith("/")
    assert sorted((a["topic"], a["partition"]) for a in described["assignments"]) == [
        (topic, 0),
        (topic, 1),
        (topic, 2),
    ]
    rows = by_partition(report)
    assert rows[0]["owner"]["client_id"] == "status-test-member"
    assert rows[0]["committed"] == 2 and rows[0]["lag"] == 3
    # Consumed, lag > 0, one sample: LAGGING, not STOPPED.
    assert {row["verdict"] for row in rows.values()} == {LAGGING}
    assert "status-test-member@" in render_table(report)
    # A Stable group whose assignment leaves a lagging partition out: nobody reads it.
    [unread_row] = [row for row in both["partitions"] if row["topic"] == unread]
    assert unread_row["owner"] is None and unread_row["verdict"] == STOPPED
    assert both["verdict"] == STOPPED


@pytest.mark.integration
def test_history_gives_throughput_and_eta(broker, kafka_settings, make_topic, group_id):
    topic = make_topic(partitions=3)
    produce(broker, topic, {0: 20, 1: 20, 2: 20})
    commit(broker, group_id, {(topic, 0): 0, (topic, 1): 0, (topic, 2): 0})
    history = StatusHistory()
    clock = iter([1000.0, 1010.0])

    first = collect_status(kafka_settings, group_id, history=history, now=lambda: next(clock))
    commit(broker, group_id, {(topic, 0): 5, (topic, 1): 5, (topic, 2): 0})
    second = collect_status(kafka_settings, group_id, history=history, now=lambda: next(clock))

    assert first["throughput"] is None and first["samples"] == 1
    assert second["samples"] == 2 and second["history_seconds"] == 10.0
    assert second["throughput"] == pytest.approx(1.0)  # 10 records in 10 s
    assert second["eta_seconds"] == pytest.approx(50.0)  # 50 left at 1 record/s
    assert by_partition(second)[0]["throughput"] == pytest.approx(0.5)


@pytest.mark.integration
def test_output_directory_rows_and_mismatches(
    broker, kafka_settings, make_topic, group_id, tmp_path
):
    topic = make_topic(partitions=3)
    produce(broker, topic, {0: 6, 1: 10, 2: 1})
    # Partition 0: offsets 0..3 (one bad record, 3 rows) and 4..5 (2 rows), committed 6.
    # Partition 1: offsets 0..2 (3 rows) but committed 8: commit past unwritten data.
    write_segment(tmp_path, topic, 0, 0, 3, [0, 1, 3], records=4)
    write_segment(tmp_path, topic, 0, 4, 5)
    write_segment(tmp_path, topic, 1, 0, 2)
    (tmp_path / "vectors" / ".half-written.parquet.tmp").write_bytes(b"not yet")
    write_index(tmp_path, {f"{topic}:0": 5, f"{topic}:1": 2})
    commit(broker, group_id, {(topic, 0): 6, (topic, 1): 8})

    report = collect_status(kafka_settings, group_id, output=tmp_path)

    rows = by_partition(report)
    assert (rows[0]["rows"], rows[0]["files"], rows[0]["covered_through"]) == (5, 2, 5)
    assert rows[0]["index_entries"] == 5 and rows[0]["mismatch"] is None
    assert rows[0]["verdict"] == OK and rows[0]["missing"] == rows[0]["doubled"] == []
    assert (rows[1]["rows"], rows[1]["covered_through"], rows[1]["index_entries"]) == (3, 2, 2)
    assert rows[1]["missing"] == [[3, 7]] and rows[1]["doubled"] == []
    assert "committed 8" in rows[1]["mismatch"] and "through 2" in rows[1]["mismatch"]
    assert "index has 2 entries for 3 rows" in rows[1]["mismatch"]
    assert rows[1]["verdict"] == MISMATCH and rows[1]["lag_verdict"] == STOPPED
    assert (rows[2]["rows"], rows[2]["covered_through"], rows[2]["index_entries"]) == (
        0,
        None,
        None,
    )
    assert rows[2]["mismatch"] is None  # nothing committed, nothing written
    assert report["verdict"] == MISMATCH and report["exit_code"] == 4
    table = render_table(report)
    assert "MISMATCH" in table and "index has 2 entries for 3 rows" in table


@pytest.mark.integration
def test_mismatch_verdicts_and_exit_code_4(broker, kafka_settings, make_topic, group_id, tmp_path):
    topic = make_topic(partitions=4)
    produce(broker, topic, {0: 10, 1: 10, 2: 10, 3: 10})
    write_segment(tmp_path, topic, 0, 0, 4)  # 0: a gap (5-6) below the commit
    write_segment(tmp_path, topic, 0, 7, 9)
    write_segment(tmp_path, topic, 1, 0, 9)  # 1: 4-6 in two segments
    write_segment(tmp_path, topic, 1, 4, 6, legacy=True)
    # 2: committed, no segments at all.  3: a damaged segment in the middle.
    write_segment(tmp_path, topic, 3, 0, 4)
    damaged = write_segment(tmp_path, topic, 3, 5, 7)
    truncate(damaged)
    write_segment(tmp_path, topic, 3, 8, 9)
    commit(broker, group_id, {(topic, p): 10 for p in range(4)})

    report = collect_status(kafka_settings, group_id, output=tmp_path)

    rows = by_partition(report)
    assert [rows[p]["verdict"] for p in range(4)] == [MISMATCH] * 4
    assert rows[0]["missing"] == [[5, 6]] and rows[0]["doubled"] == []
    assert rows[1]["doubled"] == [[4, 6]] and "in two segments" in rows[1]["mismatch"]
    assert rows[2]["missing"] == [[0, 9]] and "no segments" in rows[2]["mismatch"]
    assert rows[3]["missing"] == [[5, 7]] and rows[3]["damaged"] == [str(damaged)]
    assert any(str(damaged) in w for w in report["warnings"])
    # Lag is zero everywhere: MISMATCH alone makes the verdict.
    assert {rows[p]["lag_verdict"] for p in range(4)} == {OK}

    runner = CliRunner()
    args = ["--bootstrap-servers", broker, "status", "--group", group_id]
    assert runner.invoke(main, [*args, "--output", str(tmp_path)]).exit_code == 4
    assert runner.invoke(main, args).exit_code == 0  # without --output: caught up, OK
    as_json = runner.invoke(main, [*args, "--output", str(tmp_path), "--json"])
    assert as_json.exit_code == 4
    assert json.loads(as_json.stdout)["verdict"] == MISMATCH


@pytest.mark.integration
def test_watch_appends_reports_when_not_a_terminal(broker, kafka_settings, make_topic, group_id):
    topic = make_topic(partitions=3)
    produce(broker, topic, {0: 4})
    commit(broker, group_id, {(topic, 0): 1})
    out = io.StringIO()

    last = watch(kafka_settings, group_id, 1.0, stream=out, max_refreshes=2, sleep=lambda s: None)

    text = out.getvalue()
    assert "\x1b[" not in text  # no ANSI codes into a pipe
    assert text.count(f"group {group_id}") == 2
    assert last is not None and last["samples"] == 2 and last["total_lag"] == 3


def test_unreachable_broker_fails_fast() -> None:
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable, match=r"127\.0\.0\.1:1") as caught:
        collect_status(KafkaSettings(bootstrap_servers="127.0.0.1:1"), "any-group")
    assert time.monotonic() - started < 10
    assert "scripts/dev-kafka.sh start" in str(caught.value)
    assert caught.value.__cause__ is not None


def test_broker_down_exits_69_never_a_verdict_code() -> None:
    result = CliRunner().invoke(
        main, ["--bootstrap-servers", "127.0.0.1:1", "status", "--group", "g", "--json"]
    )
    assert result.exit_code == BrokerUnavailable.exit_code == 69
    assert result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "127.0.0.1:1" in line


@pytest.mark.parametrize(
    "args",
    [
        ["status"],  # --group missing
        ["status", "--group", "g", "--watch", "0"],  # out of range
        ["status", "--group", "g", "--nope"],  # unknown option
        ["--log-level", "LOUD", "status", "--group", "g"],  # a global option
        ["no-such-command"],
    ],
)
def test_usage_errors_exit_64_not_2(args: list[str]) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == ConfigError.exit_code == 64, result.output


def write_index(output: Path, entries: Mapping[str, int]) -> None:
    (output / "index").mkdir(parents=True, exist_ok=True)
    (output / "index" / "index.json").write_text(json.dumps({"entries": dict(entries)}))


# --------------------------------------------------------------------------- outputs (unit)


def test_output_facts_without_a_broker(tmp_path: Path) -> None:
    write_segment(tmp_path, "t", 0, 0, 9)
    write_segment(tmp_path, "t", 1, 0, 4)
    write_segment(tmp_path, "t", 1, 3, 9)
    (vectors_dir(tmp_path) / "t-p00002-00000000000000000000.parquet").write_bytes(b"junk")
    write_index(tmp_path, {"t:0": 10})
    keys = [("t", 0), ("t", 1), ("t", 2), ("t", 3)]

    facts, warnings = output_facts(tmp_path, {k: 10 for k in keys}, keys)

    assert not facts[("t", 0)].mismatched and facts[("t", 0)].mismatch() is None
    assert facts[("t", 1)].fields()["doubled"] == [[3, 4]]
    assert facts[("t", 2)].fields()["missing"] == [[0, 9]]  # its only segment is damaged
    assert facts[("t", 3)].fields()["missing"] == [[0, 9]]
    assert facts[("t", 3)].mismatch() == "committed 10 but no segments"
    assert [k for k in keys if facts[k].mismatched] == keys[1:]
    [warning] = warnings
    assert "t-p00002" in warning and "count as missing" in warning


def test_output_facts_of_a_missing_directory_warn(tmp_path: Path) -> None:
    facts, warnings = output_facts(tmp_path / "nope", {("t", 0): 3}, [("t", 0)])
    assert facts[("t", 0)].mismatched
    assert warnings == [f"{tmp_path / 'nope'} has no vectors/ folder: no segments"]


# --------------------------------------------------------------------------- verdicts (unit)


def points(*samples: tuple[float, int | None, int]) -> list[Point]:
    return [Point(*sample) for sample in samples]


@pytest.mark.parametrize(
    ("samples", "consumed", "expected"),
    [
        # One sample: use what we have.
        ([(0, 10, 10)], True, OK),
        ([(0, 10, 10)], False, OK),
        ([(0, 5, 10)], True, LAGGING),
        ([(0, 5, 10)], False, STOPPED),
        ([(0, None, 10)], True, LAGGING),
        # Committed offset frozen over the window, lag not shrinking: STALLED ...
        ([(0, 5, 10), (30, 5, 10), (60, 5, 20)], True, STALLED),
        # ... but nobody consuming at all is STOPPED, which is worse.
        ([(0, 5, 10), (60, 5, 20)], False, STOPPED),
        # ... and a frozen offset over a too short window may be one long batch.
        ([(0, 5, 10), (5, 5, 12)], True, LAGGING),
        # Commits move, but slower than the end (or just as fast): LAGGING.
        ([(0, 5, 10), (30, 10, 20), (60, 15, 30)], True, LAGGING),
        ([(0, 5, 10), (60, 15, 20)], True, LAGGING),
        # Commits outrun the end: catching up, OK.
        ([(0, 5, 20), (30, 10, 20), (60, 18, 20)], True, OK),
        # Caught up now, whatever happened before.
        ([(0, 5, 20), (60, 5, 20), (90, 20, 20)], True, OK),
        # First commit inside the window counts from there.
        ([(0, None, 20), (30, 5, 20), (90, 5, 25)], True, STALLED),
    ],
)
def test_judge_partition(samples, consumed, expected) -> None:
    assert judge_partition(points(*samples), consumed=consumed, stall_after_seconds=30) == expected


def test_verdicts_over_a_history_of_refreshes() -> None:
    history = StatusHistory(window_seconds=120, stall_after_seconds=30)
    for t, committed, end in [(0, 0, 100), (20, 40, 120), (40, 80, 140), (60, 80, 160)]:
        history.add(t, {("t", 0): (committed, end), ("t", 1): (end, end)})
    # The last 20 s froze, but over the window the lag shrank (100 -> 80): catching up.
    assert judge_partition(history.points("t", 0), consumed=True) == OK
    history.add(80, {("t", 0): (80, 180), ("t", 1): (180, 180)})
    history.add(200, {("t", 0): (80, 200), ("t", 1): (200, 200)})
    # The window (120 s) now starts at t=80: commits frozen since, lag growing.
    assert [p.time for p in history.points("t", 0)] == [80, 200]
    assert judge_partition(history.points("t", 0), consumed=True) == STALLED
    assert judge_partition(history.points("t", 1), consumed=True) == OK
    assert worst([OK, STALLED, LAGGING]) == STALLED
    assert worst([]) == OK


def test_history_keeps_two_samples_and_caps_its_length() -> None:
    history = StatusHistory(window_seconds=10, max_samples=3)
    history.add(0, {("t", 0): (1, 2)})
    history.add(1000, {("t", 0): (1, 3)})
    assert len(history.samples) == 2  # older than the window, but a trend needs two
    for t in range(1001, 1006):
        history.add(t, {("t", 0): (1, 3)})
    assert [when for when, _ in history.samples] == [1003, 1004, 1005]


def test_history_round_trips_through_a_file(tmp_path: Path) -> None:
    history = StatusHistory(window_seconds=300, stall_after_seconds=12, group="g")
    history.add(1.5, {("a.b:c", 0): (None, 4), ("x", 2): (3, 9)})
    history.add(2.5, {("a.b:c", 0): (1, 5)})
    path = tmp_path / "history.json"
    history.save(path)

    loaded = StatusHistory.load(path)
    assert loaded.to_dict() == history.to_dict()
    assert loaded.points("a.b:c", 0) == [Point(1.5, None, 4), Point(2.5, 1, 5)]
    assert StatusHistory.load(tmp_path / "absent.json").samples == []


def test_rates_and_eta() -> None:
    window = points((0, 10, 100), (10, 30, 110))
    assert commit_rate(window) == pytest.approx(2.0)
    assert commit_rate(points((0, 10, 100))) is None
    assert drain_eta(80, 2.0, 1.0) == pytest.approx(80.0)  # net 1 record/s
    assert drain_eta(80, 1.0, 1.0) is None  # never drains
    assert drain_eta(0, None, None) == 0.0


def test_exit_codes() -> None:
    assert [exit_code_for(v) for v in (OK, LAGGING, STALLED, STOPPED, MISMATCH)] == [0, 1, 2, 3, 4]
    assert worst([STOPPED, MISMATCH, OK]) == MISMATCH  # the most severe
    # No operational error may look like a verdict.
    from pipeline.core import errors

    codes = {
        c.exit_code
        for c in vars(errors).values()
        if isinstance(c, type) and issubclass(c, errors.PipelineError)
    }
    assert codes and min(codes) > 4
    with pytest.raises(ValueError, match="unknown verdict"):
        exit_code_for("FINE")


# --------------------------------------------------------------------------- rendering and watch


def synthetic_report(**overrides: Any) -> dict[str, Any]:
    report: dict[str, Any] = {
        "group": "embedders",
        "state": "Stable",
        "members": [{"member_id": "m1", "client_id": "w1", "host": "10.0.0.7", "assignments": []}],
        "total_lag": 1234,
        "max_lag_seconds": 95.0,
        "throughput": 12.5,
        "eta_seconds": 98.7,
        "verdict": LAGGING,
        "dead_letter": {"topic": "docs.dlq", "records": 7},
        "output": None,
        "warnings": [],
        "partitions": [
            {
                "topic": "docs",
                "partition": 0,
                "committed": 100,
                "end": 1334,
                "lag": 1234,
                "lag_seconds": 95.0,
                "owner": {"member_id": "m1", "client_id": "w1", "host": "10.0.0.7"},
                "verdict": LAGGING,
            },
            {
                "topic": "docs",
                "partition": 1,
                "committed": None,
                "end": 0,
                "lag": 0,
                "lag_seconds": None,
                "owner": None,
                "verdict": OK,
            },
        ],
    }
    report.update(overrides)
    return report


def test_render_table_shows_the_key_numbers() -> None:
    text = render_table(synthetic_report())
    header, columns, first, second = text.splitlines()
    for needle in ("embedders", "Stable", "members 1", "total lag 1234", "12.5 rec/s"):
        assert needle in header
    assert "1m35s" in header and "1m39s" in header  # lag seconds and ETA
    assert "LAGGING" in header and "dead-letter 7" in header
    assert columns.split() == [
        "TOPIC",
        "PARTITION",
        "COMMITTED",
        "END",
        "LAG",
        "LAG_S",
        "OWNER",
        "VERDICT",
    ]
    assert first.split() == ["docs", "0", "100", "1334", "1234", "95.0", "w1@10.0.0.7", "LAGGING"]
    assert second.split() == ["docs", "1", "-", "0", "0", "-", "-", "OK"]
    assert len(columns) >= len(first.rstrip())  # aligned under the header


def test_render_table_with_output_columns() -> None:
    report = synthetic_report(output="/data/out", warnings=["cannot read x"])
    report["partitions"][0].update(rows=90, index_entries=80, mismatch="index has 80 entries")
    report["partitions"][1].update(rows=0, index_entries=None, mismatch=None)
    lines = render_table(report).splitlines()
    assert lines[1].split()[-3:] == ["ROWS", "INDEX", "MISMATCH"]
    assert "90" in lines[2] and "80" in lines[2] and "index has 80 entries" in lines[2]
    assert lines[-1] == "warning: cannot read x"


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_watch_redraws_in_place_and_survives_later_errors() -> None:
    results: list[Any] = [
        synthetic_report(),
        PipelineError("no Kafka broker answered at x:1"),
        synthetic_report(total_lag=7),
    ]
    histories = []

    def fake_collect(kafka, group, topics, output, history, **kwargs):
        histories.append(history)
        result = results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result

    out = FakeTerminal()
    last = watch(
        KafkaSettings(),
        "embedders",
        2,
        stream=out,
        max_refreshes=3,
        sleep=lambda s: None,
        collect=fake_collect,
    )

    text = out.getvalue()
    assert text.count("\x1b[H\x1b[2J") == 3
    assert "error: no Kafka broker answered at x:1" in text
    assert last is not None and last["total_lag"] == 7
    assert len({id(h) for h in histories}) == 1  # one history across refreshes


def test_watch_raises_the_first_error_and_stops_on_ctrl_c() -> None:
    def broken(*args, **kwargs):
        raise BrokerUnavailable("no Kafka broker answered at x:1")

    with pytest.raises(BrokerUnavailable):
        watch(KafkaSettings(), "g", 1, stream=io.StringIO(), sleep=lambda s: None, collect=broken)

    def interrupt(seconds: float) -> None:
        raise KeyboardInterrupt

    out = io.StringIO()
    last = watch(
        KafkaSettings(),
        "g",
        1,
        stream=out,
        as_json=True,
        sleep=interrupt,
        collect=lambda *a, **k: synthetic_report(),
    )
    assert last is not None
    assert json.loads(out.getvalue().splitlines()[0])["total_lag"] == 1234
