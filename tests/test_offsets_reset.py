"""`pipeline offsets reset`: each mode against the real broker, with the committed
offsets read back by a plain kafka-python consumer (not the command's own account);
clamping, dry runs, the refusal while the group has a live member, and the
one-line errors (missing topic, no broker, bad flags)."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from click.testing import CliRunner, Result
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient
from kafka.structs import OffsetAndMetadata

from pipeline.cli import main
from pipeline.core.errors import BrokerUnavailable, ConfigError, TopicMissing
from pipeline.kafka.cluster import GroupInfo, GroupMember
from pipeline.kafka.offsets import (
    DATETIME,
    EARLIEST,
    OFFSET,
    SHIFT,
    GroupActive,
    ResetMode,
    ResetResult,
    TopicSpec,
    choose_mode,
    parse_datetime,
    parse_topic_spec,
    plan_partition,
    render_table,
)
from tests.helpers import committed_offsets
from tests.test_errors import UNREACHABLE, error_line, pipeline

T0 = 1_714_564_800_000  # 2024-05-01T12:00:00Z, in ms (for the units)
MINUTE = 60_000
HEADER = ["TOPIC", "PARTITION", "CURRENT-OFFSET", "NEW-OFFSET", "CHANGE", "NOTE"]
# Records on the broker are stamped within the last hour: the dev broker's 24-hour
# time retention deletes older ones whenever its retention check happens to run.
BASE = (int(time.time() * 1000) - 60 * MINUTE) // MINUTE * MINUTE


def iso(millis: int, hours: int | None = None) -> str:
    """`millis` in ISO 8601 at UTC+hours; no timezone at all when `hours` is None."""
    zone = dt.timezone(dt.timedelta(hours=hours or 0))
    moment = dt.datetime.fromtimestamp(millis / 1000, zone)
    return (moment if hours is not None else moment.replace(tzinfo=None)).isoformat()


def fill(broker: str, topic: str, counts: dict[int, int]) -> None:
    """`counts[p]` records in partition p, the i-th stamped BASE + i minutes."""
    producer = KafkaProducer(bootstrap_servers=broker, acks="all")
    for partition, count in counts.items():
        for i in range(count):
            value = json.dumps({"text": f"record {i}"}).encode()
            producer.send(topic, value, partition=partition, timestamp_ms=BASE + i * MINUTE)
    producer.flush(30)
    producer.close()


def commit(broker: str, group: str, topic: str, offsets: dict[int, int]) -> None:
    """Commits as a consumer of the group would (without joining it)."""
    consumer = KafkaConsumer(bootstrap_servers=broker, group_id=group, enable_auto_commit=False)
    consumer.commit(
        {TopicPartition(topic, p): OffsetAndMetadata(o, "", -1) for p, o in offsets.items()}
    )
    consumer.close(autocommit=False)


def reset(broker: str, *args: str) -> Result:
    """`pipeline offsets reset ARGS` in this process."""
    return CliRunner().invoke(main, ["--bootstrap-servers", broker, "offsets", "reset", *args])


def ok(result: Result) -> Result:
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture
def topic(broker: str, make_topic: Callable[..., str]) -> str:
    """Two partitions: 6 records in 0, 4 in 1."""
    name = make_topic(2)
    fill(broker, name, {0: 6, 1: 4})
    return name


def admin_offsets(broker: str, group: str) -> dict[TopicPartition, int]:
    """The group's committed offsets as a plain admin client reads them."""
    admin = KafkaAdminClient(bootstrap_servers=broker)
    try:
        listed = admin.list_group_offsets({group: None})[group]
        return {tp: meta.offset for tp, meta in listed.items() if meta.offset >= 0}
    finally:
        admin.close()


@contextmanager
def live_member(broker: str, group: str, topic: str) -> Iterator[KafkaConsumer]:
    """A consumer that has joined `group` (assigned its partitions) until the block ends."""
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=broker,
        group_id=group,
        client_id="reset-test-worker",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    try:
        # The topic is seconds old: without its metadata the group's leader would
        # assign nothing (kafka-python's range assignor), and nothing would change that
        # until the next metadata refresh, minutes away.
        consumer.topics()
        deadline = time.monotonic() + 30
        while not consumer.assignment():
            assert time.monotonic() < deadline, "the consumer did not join its group"
            consumer.poll(timeout_ms=200)
        yield consumer
    finally:
        consumer.close(autocommit=False)
        _wait_until_left(broker, group)


def _wait_until_left(broker: str, group: str) -> None:
    # close() sends LeaveGroup without waiting for the answer; the test goes on only
    # once the broker agrees the group is empty.
    admin = KafkaAdminClient(bootstrap_servers=broker)
    try:
        deadline = time.monotonic() + 30
        while admin.describe_groups([group])[group]["members"]:
            assert time.monotonic() < deadline, "the consumer did not leave its group"
            time.sleep(0.1)
    finally:
        admin.close()


# ------------------------------------------------------------------ units


@pytest.mark.parametrize(
    ("text", "millis"),
    [
        ("2024-05-01T12:00:00Z", T0),
        ("2024-05-01T12:00:00+00:00", T0),
        ("2024-05-01T14:00:00+02:00", T0),
        ("2024-05-01T12:00:00", T0),  # no timezone: UTC
        ("2024-05-01 12:00", T0),
        ("2024-05-01T12:00:00.250Z", T0 + 250),
        ("2024-05-01T12:00:00.000001Z", T0 + 1),  # rounded up: records are whole ms
        ("2024-05-01", T0 - 12 * 60 * MINUTE),
        ("1970-01-01T00:00:00Z", 0),
    ],
)
def test_parse_datetime(text: str, millis: int) -> None:
    assert parse_datetime(text) == millis


@pytest.mark.parametrize("text", ["yesterday", "2024-13-01", "", "1969-12-31T23:59:59Z"])
def test_parse_datetime_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="--to-datetime"):
        parse_datetime(text)


def test_parse_topic_spec() -> None:
    assert parse_topic_spec("docs") == TopicSpec("docs")
    assert parse_topic_spec("docs:2,0,2") == TopicSpec("docs", (0, 2))
    for bad in ("docs:x", "docs:", ":1", "docs:-1"):
        with pytest.raises(ConfigError, match="--topic"):
            parse_topic_spec(bad)


def test_exactly_one_mode() -> None:
    assert choose_mode(True, False, None, None, None) == ResetMode(EARLIEST)
    assert choose_mode(False, False, None, 0, None) == ResetMode(OFFSET, 0)
    assert choose_mode(False, False, None, None, -3) == ResetMode(SHIFT, -3)
    assert choose_mode(False, False, "2024-05-01T12:00:00Z", None, None) == ResetMode(DATETIME, T0)
    with pytest.raises(ConfigError, match="exactly one"):
        choose_mode(False, False, None, None, None)
    with pytest.raises(ConfigError, match="--to-earliest, --shift-by"):
        choose_mode(True, False, None, None, 1)


def test_plan_clamps_into_earliest_and_end() -> None:
    tp = TopicPartition("t", 0)
    high = plan_partition(tp, ResetMode(OFFSET, 99), 5, 2, 10)
    assert (high.new, high.requested, high.clamped) == (10, 99, True)
    assert "clamped to end" in high.note
    low = plan_partition(tp, ResetMode(SHIFT, -9), 5, 2, 10)
    assert (low.new, low.clamped) == (2, True) and "clamped to earliest" in low.note
    fresh = plan_partition(tp, ResetMode(SHIFT, 3), None, 2, 10)
    assert (fresh.new, fresh.clamped) == (5, False) and "from earliest" in fresh.note
    past = plan_partition(tp, ResetMode(DATETIME, T0), 5, 2, 10, at_time=None)
    assert past.new == 10 and "no record" in past.note


def test_dry_run_summary_says_the_reset_would_refuse() -> None:
    plan = [plan_partition(TopicPartition("t", 0), ResetMode(EARLIEST), 5, 2, 10)]
    assert plan[0].change == -3 and "-3" in render_table(ResetResult("g", plan, False))
    members = tuple(GroupMember(f"w{i}", "10.0.0.1") for i in range(7))
    busy = ResetResult("g", plan, committed=False, active=GroupInfo("Stable", members)).summary()
    assert busy.startswith("dry run: nothing changed (group g, 1 partition(s)); ")
    assert "7 active member(s) (w0@10.0.0.1, " in busy and "w4@10.0.0.1 and 2 more" in busy
    assert "the reset without --dry-run will refuse until they stop" in busy
    moving = ResetResult("g", plan, committed=False, active=GroupInfo("PreparingRebalance", ()))
    assert "g is PreparingRebalance, not Empty: the reset without --dry-run" in moving.summary()


# ------------------------------------------------------------------ the five modes


@pytest.mark.integration
def test_to_earliest_and_to_latest(broker: str, topic: str, group_id: str) -> None:
    commit(broker, group_id, topic, {0: 3})

    latest = ok(reset(broker, "--group", group_id, "--topic", topic, "--to-latest"))
    assert committed_offsets(broker, group_id, topic) == {0: 6, 1: 4}
    assert "committed" in latest.output.splitlines()[-1]

    ok(reset(broker, "--group", group_id, "--topic", topic, "--to-earliest"))
    assert committed_offsets(broker, group_id, topic) == {0: 0, 1: 0}


@pytest.mark.integration
def test_to_datetime(broker: str, topic: str, group_id: str) -> None:
    def to(moment: str) -> Result:
        return ok(reset(broker, "--group", group_id, "--topic", topic, "--to-datetime", moment))

    # A group that does not exist yet: the reset gives it its offsets. No timezone: UTC.
    to(iso(BASE + 2 * MINUTE))
    assert committed_offsets(broker, group_id, topic) == {0: 2, 1: 2}

    # Between two records, in another timezone: the first record at or after it.
    to(iso(BASE + 4 * MINUTE + 30_000, hours=2))
    assert committed_offsets(broker, group_id, topic) == {0: 5, 1: 4}

    after = to("2099-01-01Z")
    assert committed_offsets(broker, group_id, topic) == {0: 6, 1: 4}
    assert "no record at or after the time" in after.output


@pytest.mark.integration
def test_to_offset_is_clamped(broker: str, topic: str, group_id: str) -> None:
    admin = KafkaAdminClient(bootstrap_servers=broker)
    admin.delete_records({TopicPartition(topic, 0): 2})  # partition 0 now starts at 2
    admin.close()

    low = ok(reset(broker, "--group", group_id, "--topic", topic, "--to-offset", "1"))
    assert committed_offsets(broker, group_id, topic) == {0: 2, 1: 1}
    assert "clamped to earliest (asked 1)" in low.output

    high = ok(reset(broker, "--group", group_id, "--topic", topic, "--to-offset", "5", "--json"))
    assert committed_offsets(broker, group_id, topic) == {0: 5, 1: 4}
    rows = {row["partition"]: row for row in json.loads(high.stdout)}
    assert rows[0]["clamped"] is False and rows[0]["new"] == 5 and rows[0]["current"] == 2
    assert rows[1]["clamped"] is True and rows[1]["requested"] == 5 and rows[1]["end"] == 4


@pytest.mark.integration
def test_shift_by(broker: str, topic: str, group_id: str) -> None:
    commit(broker, group_id, topic, {0: 3})  # nothing committed on partition 1

    ok(reset(broker, "--group", group_id, "--topic", topic, "--shift-by", "2"))
    assert committed_offsets(broker, group_id, topic) == {0: 5, 1: 2}  # 1: from earliest

    back = ok(reset(broker, "--group", group_id, "--topic", topic, "--shift-by", "-4"))
    assert committed_offsets(broker, group_id, topic) == {0: 1, 1: 0}
    assert "clamped to earliest (asked -2)" in back.output

    ok(reset(broker, "--group", group_id, "--topic", topic, "--shift-by", "100"))
    assert committed_offsets(broker, group_id, topic) == {0: 6, 1: 4}


@pytest.mark.integration
def test_some_partitions_only(broker: str, topic: str, group_id: str) -> None:
    commit(broker, group_id, topic, {0: 3, 1: 3})

    ok(reset(broker, "--group", group_id, "--topic", f"{topic}:1", "--to-earliest"))
    assert committed_offsets(broker, group_id, topic) == {0: 3, 1: 0}


@pytest.mark.integration
def test_dry_run_changes_nothing(broker: str, topic: str, group_id: str) -> None:
    commit(broker, group_id, topic, {0: 3})

    shown = ok(reset(broker, "--group", group_id, "--topic", topic, "--to-latest", "--dry-run"))

    assert committed_offsets(broker, group_id, topic) == {0: 3, 1: None}
    lines = shown.stdout.splitlines()
    assert lines[0].split() == HEADER
    assert lines[1].split() == [topic, "0", "3", "6", "+3"]
    assert lines[2].split() == [topic, "1", "-", "4", "-"]
    assert lines[-1].startswith("dry run: nothing changed")
    assert "member" not in lines[-1]

    as_json = ok(
        reset(broker, "--group", group_id, "--topic", topic, "--to-earliest", "--dry-run", "--json")
    )
    rows = json.loads(as_json.stdout)
    assert [(r["partition"], r["current"], r["new"], r["change"]) for r in rows] == [
        (0, 3, 0, -3),
        (1, None, 0, None),
    ]
    assert committed_offsets(broker, group_id, topic) == {0: 3, 1: None}


# ------------------------------------------------------------------ refusals and errors


@pytest.mark.integration
def test_refused_while_the_group_has_a_member(broker: str, topic: str, group_id: str) -> None:
    commit(broker, group_id, topic, {0: 3, 1: 3})
    args = ("offsets", "reset", "--group", group_id, "--topic", topic, "--to-earliest")

    with live_member(broker, group_id, topic):
        refused = pipeline(*args, bootstrap=broker)
        line = error_line(refused, GroupActive)
        assert "reset-test-worker@127.0.0.1" in line and "stop its workers" in line
        assert committed_offsets(broker, group_id, topic) == {0: 3, 1: 3}

    done = pipeline(*args, bootstrap=broker)
    assert done.returncode == 0, done.stderr
    assert committed_offsets(broker, group_id, topic) == {0: 0, 1: 0}


@pytest.mark.integration
def test_dry_run_with_a_live_member_shows_the_plan(broker: str, topic: str, group_id: str) -> None:
    commit(broker, group_id, topic, {0: 3, 1: 1})
    args = ("offsets", "reset", "--group", group_id, "--topic", topic, "--to-earliest")
    before = {TopicPartition(topic, 0): 3, TopicPartition(topic, 1): 1}

    with live_member(broker, group_id, topic):
        assert admin_offsets(broker, group_id) == before
        shown = pipeline(*args, "--dry-run", bootstrap=broker)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        lines = shown.stdout.splitlines()
        assert lines[0].split() == HEADER
        assert lines[1].split() == [topic, "0", "3", "0", "-3"]
        assert lines[2].split() == [topic, "1", "1", "0", "-1"]
        closing = lines[-1]
        assert closing.startswith("dry run: nothing changed"), shown.stdout
        assert "the group has 1 active member(s) (reset-test-worker@127.0.0.1" in closing
        assert "the reset without --dry-run will refuse until they stop" in closing
        assert admin_offsets(broker, group_id) == before

        as_json = ok(reset(broker, *args[2:], "--dry-run", "--json"))
        rows = json.loads(as_json.stdout)
        assert [(r["current"], r["new"], r["change"]) for r in rows] == [(3, 0, -3), (1, 0, -1)]
        assert "1 active member(s)" in as_json.stderr
        assert admin_offsets(broker, group_id) == before

        # The reset itself still refuses, with the same one line as ever.
        refused = pipeline(*args, bootstrap=broker)
        line = error_line(refused, GroupActive)
        assert f"group {group_id} has 1 active member(s) (reset-test-worker@127.0.0.1" in line
        assert "stop its workers (pipeline run) first" in line
        assert admin_offsets(broker, group_id) == before


@pytest.mark.integration
def test_unknown_topic_is_one_line(broker: str, group_id: str) -> None:
    missing = "missing-topic-for-offsets-reset"
    result = pipeline(
        "offsets",
        "reset",
        "--group",
        group_id,
        "--topic",
        missing,
        "--to-earliest",
        bootstrap=broker,
    )
    assert missing in error_line(result, TopicMissing)


def test_broker_unreachable_is_one_line() -> None:
    result = pipeline("offsets", "reset", "--group", "g", "--topic", "t", "--to-earliest")
    line = error_line(result, BrokerUnavailable)
    assert UNREACHABLE in line and "--bootstrap-servers" in line


@pytest.mark.parametrize(
    "modes", [(), ("--to-earliest", "--to-latest"), ("--to-offset", "3", "--shift-by", "-1")]
)
def test_not_exactly_one_mode_is_a_usage_error(modes: tuple[str, ...]) -> None:
    result = pipeline("offsets", "reset", "--group", "g", "--topic", "t", *modes)
    assert "exactly one of" in error_line(result, ConfigError)
