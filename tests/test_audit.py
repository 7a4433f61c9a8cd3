"""`pipeline audit`: the accounting on synthetic output directories (no broker),
then real workers, the real broker and damaged, doubled and transactional outputs."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

from pipeline.audit import (
    DamagedFile,
    Range,
    audit_partition,
    check_coverage,
    complement,
    describe_ranges,
    merge,
    output_coverage,
    read_output_rows,
    render_audit,
    runs,
    within,
)
from pipeline.core.layout import SegmentKey, segments_by_partition, vectors_dir
from sinks.segments import START_FROM_COMMITTED, read_info
from tests.helpers import (
    PIPELINE,
    REPO,
    corpus_records,
    output_rows,
    publish_json,
    publish_raw,
    publish_with_keys_not_utf8,
    run_until_end,
    truncate,
    worker_env,
    write_segment,
)

# --------------------------------------------------------------------------- fixtures


class FakeKafka:
    """A Scan over a fixed set of offsets that hold a record; remembers what it was asked."""

    def __init__(self, records: Iterable[int], start_after: int = 0) -> None:
        self.records = np.array(sorted(records), dtype=np.int64)
        self.start_after = start_after
        self.asked: list[list[Range]] = []

    def __call__(self, key: tuple[str, int], ranges: Sequence[Range]) -> tuple[np.ndarray, int]:
        self.asked.append(list(ranges))
        return self.records[within(self.records, ranges)], self.start_after


def offsets(*values: int) -> np.ndarray:
    return np.array(sorted(values), dtype=np.int64)


def account(
    output: Path,
    committed: int | None,
    kafka: FakeKafka,
    dead_letters: np.ndarray | None = None,
    *,
    log_start: int = 0,
    end: int = 10_000,
    key: tuple[str, int] = ("t", 0),
):
    """audit_partition over a synthetic output directory."""
    rows = read_output_rows(output, [key[0]])
    dead = offsets() if dead_letters is None else dead_letters
    coverage = rows.coverage(key, committed)
    return audit_partition(key, committed, log_start, end, rows.rows_of(key), dead, coverage, kafka)


# --------------------------------------------------------------------------- ranges (unit)


def test_range_helpers() -> None:
    assert runs(offsets(0, 1, 2, 5, 7, 8)) == [(0, 2), (5, 5), (7, 8)]
    assert runs(offsets()) == []
    assert merge([(5, 6), (0, 2), (3, 3), (10, 12), (11, 20)]) == [(0, 3), (5, 6), (10, 20)]
    assert merge([(0, 1), (5, 6)], within=3) == [(0, 6)]
    assert merge([(0, 1), (6, 6)], within=3) == [(0, 1), (6, 6)]
    assert complement(0, 10, [(2, 3), (5, 12)]) == [(0, 1), (4, 4)]
    assert complement(3, 3, [(0, 1)]) == []
    assert complement(0, 4, []) == [(0, 3)]
    mask = within(offsets(0, 2, 3, 9, 10, 11), [(2, 3), (10, 10)])
    assert mask.tolist() == [False, True, True, False, True, False]
    assert describe_ranges([(1, 1), (3, 5)]) == "1,3-5"
    assert describe_ranges([(i, i) for i in range(0, 20, 2)], limit=3) == "0,2,4 (+7 more)"
    assert describe_ranges([]) == "-"


# --------------------------------------------------------------------------- coverage (unit)


def test_coverage_of_tiling_segments_is_ok(tmp_path: Path) -> None:
    write_segment(tmp_path, "t", 0, 0, 3, [0, 1, 3], records=4)  # 2 was dead-lettered
    write_segment(tmp_path, "t", 0, 4, 9)
    write_segment(tmp_path, "t", 0, 10, 14, legacy=True)

    [coverage] = output_coverage(tmp_path, {("t", 0): 15}).values()

    assert coverage.ok and coverage.problems() == []
    assert (coverage.files, coverage.rows, coverage.first, coverage.covered_through) == (
        3,
        14,
        0,
        14,
    )
    # Segments past the committed offset (published, commit pending) are fine.
    assert output_coverage(tmp_path, {("t", 0): 5})[("t", 0)].ok


def test_coverage_gap_overlap_and_commits_without_segments(tmp_path: Path) -> None:
    write_segment(tmp_path, "t", 0, 0, 3)
    write_segment(tmp_path, "t", 0, 6, 9)  # 4-5 in no segment
    write_segment(tmp_path, "t", 0, 8, 12, legacy=True)  # 8-9 in two segments
    write_segment(tmp_path, "u", 0, 0, 4)

    found = output_coverage(tmp_path, {("t", 0): 15, ("t", 1): 7, ("u", 0): 3})

    gapped = found[("t", 0)]
    assert gapped.gaps == ((4, 5), (13, 14)) and gapped.overlaps == ((8, 9),)
    assert not gapped.ok
    assert "offsets 4-5,13-14 below committed 15 in no segment" in "; ".join(gapped.problems())
    assert "offsets 8-9 in two segments" in "; ".join(gapped.problems())
    empty = found[("t", 1)]
    assert empty.files == 0 and empty.gaps == ((0, 6),)
    assert empty.problems() == ["committed 7 but no segments"]
    assert found[("u", 0)].ok
    # Restricting to topics leaves the others out.
    assert set(output_coverage(tmp_path, {("t", 0): 15}, topics=["u"])) == {("u", 0)}


def test_damaged_segment_counts_as_a_gap_without_crashing(tmp_path: Path) -> None:
    write_segment(tmp_path, "t", 0, 0, 3)
    truncate(write_segment(tmp_path, "t", 0, 4, 7))
    write_segment(tmp_path, "t", 0, 8, 9)
    (vectors_dir(tmp_path) / "t-p00000-00000000000000000010.parquet").write_bytes(b"junk")

    coverage = output_coverage(tmp_path, {("t", 0): 12})[("t", 0)]

    assert coverage.gaps == ((4, 7), (10, 11))
    assert [d.first for d in coverage.damaged] == [4, 10]
    assert all(isinstance(d, DamagedFile) and d.reason for d in coverage.damaged)
    assert coverage.files == 4 and coverage.rows == 6


def test_a_damaged_first_segment_still_anchors_the_check(tmp_path: Path) -> None:
    truncate(write_segment(tmp_path, "t", 0, 100, 104))
    coverage = check_coverage(("t", 0), [], [_damaged(tmp_path, 100)], committed=105)
    assert coverage.first == 100 and coverage.gaps == ((100, 104),)


def _damaged(output: Path, first: int) -> DamagedFile:
    path = vectors_dir(output) / SegmentKey("t", 0, first).filename
    return DamagedFile(str(path), "t", 0, first, "truncated")


# --------------------------------------------------------------------------- accounting (unit)


def test_rows_and_dead_letters_account_for_everything_without_reading_kafka(
    tmp_path: Path,
) -> None:
    write_segment(tmp_path, "t", 0, 0, 4, [0, 1, 3, 4], records=5)
    write_segment(tmp_path, "t", 0, 5, 9)
    kafka = FakeKafka(range(10))

    result = account(tmp_path, 10, kafka, dead_letters=offsets(2))

    assert result.ok and result.missing == [] and result.doubled == []
    assert (result.rows, result.dead_lettered, result.unverifiable) == (9, 1, 0)
    assert kafka.asked == []  # nothing unaccounted: nothing to read


def test_a_segments_range_never_excuses_a_real_record(tmp_path: Path) -> None:
    # The segment claims 0-9 (10 records consumed, 5 of them "dead-lettered"),
    # but the dead-letter topic has none of them: Kafka is asked, and says 6 and 8
    # are real records; 5, 7 and 9 have none (markers, aborted records).
    write_segment(tmp_path, "t", 0, 0, 9, [0, 1, 2, 3, 4], records=10)
    kafka = FakeKafka([*range(5), 6, 8])

    result = account(tmp_path, 10, kafka)

    assert kafka.asked == [[(5, 9)]]
    assert result.missing == [(6, 6), (8, 8)] and not result.ok
    assert (result.scanned, result.without_record, result.unverifiable) == (5, 3, 0)
    assert result.coverage.ok  # the footers alone look perfect


def test_deleted_segment_is_missing_and_only_the_gaps_are_read(tmp_path: Path) -> None:
    write_segment(tmp_path, "t", 0, 0, 9)
    write_segment(tmp_path, "t", 0, 20, 29)
    kafka = FakeKafka(range(30))

    result = account(tmp_path, 30, kafka)

    assert kafka.asked == [[(10, 19)]]
    assert result.missing == [(10, 19)] and result.coverage.gaps == ((10, 19),)


def test_doubled_rows_across_files_and_row_plus_dead_letter(tmp_path: Path) -> None:
    write_segment(tmp_path, "t", 0, 0, 9)
    write_segment(tmp_path, "t", 0, 5, 7, legacy=True)  # the same rows again
    write_segment(tmp_path, "t", 0, 10, 14, [10, 11, 12, 12], records=5)  # 13, 14 dead
    dead = offsets(3, 13, 14, 14)  # 3 also a row; 14 dead-lettered twice

    result = account(tmp_path, 15, FakeKafka(range(15)), dead_letters=dead)

    assert result.doubled == [(3, 3), (5, 7), (12, 12)]
    assert result.dead_letter_repeats == [(14, 14)]
    assert result.missing == [] and not result.ok
    assert result.coverage.overlaps == ((5, 7),)


def test_a_bad_record_dead_lettered_twice_fails_the_audit(tmp_path: Path) -> None:
    write_segment(tmp_path, "t", 0, 0, 4, [0, 1, 2], records=5)
    result = account(tmp_path, 5, FakeKafka(range(5)), dead_letters=offsets(3, 3, 4))
    assert result.dead_letter_repeats == [(3, 3)] and result.dead_lettered == 2
    assert not result.ok and result.missing == [] and result.doubled == []


def test_offsets_below_the_log_start_are_unverifiable_not_missing(tmp_path: Path) -> None:
    write_segment(tmp_path, "t", 0, 100, 109)
    kafka = FakeKafka(range(50, 110))

    result = account(tmp_path, 110, kafka, log_start=50)

    assert kafka.asked == [[(50, 99)]]
    assert result.missing == [(50, 99)]
    assert result.unverifiable == 50  # 0-49: deleted by retention, nothing to compare with


def test_retention_during_the_scan_makes_unseen_offsets_unverifiable(tmp_path: Path) -> None:
    write_segment(tmp_path, "t", 0, 20, 29)
    # Kafka returned 15-19 but had deleted 0-14 before the reader reached them.
    kafka = FakeKafka(range(15, 30), start_after=15)

    result = account(tmp_path, 30, kafka)

    assert result.missing == [(15, 19)]
    assert (result.unverifiable, result.without_record) == (15, 0)


def test_offsets_past_the_last_stable_offset_are_unverifiable(tmp_path: Path) -> None:
    write_segment(tmp_path, "t", 0, 0, 4)
    kafka = FakeKafka(range(10))
    result = account(tmp_path, 10, kafka, end=7)
    assert kafka.asked == [[(5, 6)]]
    assert result.missing == [(5, 6)] and result.unverifiable == 3


def test_a_start_from_committed_excuses_what_lies_below_it(tmp_path: Path) -> None:
    write_segment(tmp_path, "t", 0, 500, 509, start=START_FROM_COMMITTED)
    kafka = FakeKafka(range(510))

    result = account(tmp_path, 510, kafka)

    assert result.ok and result.checked_from == 500 and kafka.asked == []
    # Without the note, the same directory misses 0-499.
    shutil.rmtree(vectors_dir(tmp_path))
    write_segment(tmp_path, "t", 0, 500, 509)
    assert account(tmp_path, 510, FakeKafka(range(510))).missing == [(0, 499)]


def test_damaged_segment_rows_are_read_again_from_kafka(tmp_path: Path) -> None:
    write_segment(tmp_path, "t", 0, 0, 4)
    truncate(write_segment(tmp_path, "t", 0, 5, 9))

    rows = read_output_rows(tmp_path, ["t"])
    result = account(tmp_path, 10, FakeKafka(range(10)))

    assert [d.first for d in rows.damaged[("t", 0)]] == [5]
    assert result.missing == [(5, 9)]
    assert [d.first for d in result.coverage.damaged] == [5]


def test_nothing_committed_checks_doubles_only(tmp_path: Path) -> None:
    write_segment(tmp_path, "t", 0, 0, 2, [0, 1, 1])
    kafka = FakeKafka(range(3))
    result = account(tmp_path, None, kafka)
    assert kafka.asked == [] and result.missing == [] and result.doubled == [(1, 1)]


def test_render_audit_lists_problems_and_the_verdict() -> None:
    partition = {
        "topic": "docs",
        "partition": 0,
        "committed": 30,
        "rows": 19,
        "dead_lettered": 1,
        "missing": [[10, 19]],
        "doubled": [[3, 3]],
        "unverifiable": 0,
        "dead_letter_repeats": [],
    }
    report = {
        "group": "g",
        "partitions": [partition],
        "totals": {
            "partitions": 1,
            "rows": 19,
            "dead_lettered": 1,
            "missing": 10,
            "doubled": 1,
            "dead_letter_repeats": 2,
            "unverifiable": 0,
            "damaged_files": 1,
        },
        "damaged": [{"file": "/o/vectors/x.parquet", "first": 5, "reason": "truncated"}],
        "warnings": ["something odd"],
        "ok": False,
    }
    lines = render_audit(report).splitlines()
    assert lines[0].split() == [
        "TOPIC",
        "PARTITION",
        "COMMITTED",
        "ROWS",
        "DEAD",
        "MISSING",
        "DOUBLED",
        "UNVERIFIABLE",
        "DLQ_REPEATS",
    ]
    assert lines[1].split() == ["docs", "0", "30", "19", "1", "10-19", "3", "0", "-"]
    assert "damaged: /o/vectors/x.parquet (truncated)" in lines
    assert "warning: something odd" in lines
    assert lines[-1].startswith("audit FAILED") and "10 missing" in lines[-1]
    assert "2 dead-lettered twice" in lines[-1]


# --------------------------------------------------------------------------- integration


def pipeline_audit(broker: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PIPELINE, "audit", *args],
        env=worker_env(broker),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def audit_json(
    broker: str, output: Path, group: str, topic: str
) -> tuple[int, dict[str, Any], str]:
    result = pipeline_audit(
        broker, "--output", str(output), "--group", group, "--topic", topic, "--json"
    )
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, json.loads(result.stdout), result.stderr


def partitions_of(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {p["partition"]: p for p in report["partitions"]}


@pytest.fixture(scope="module")
def admin(broker: str) -> Iterator[KafkaAdminClient]:
    client = KafkaAdminClient(bootstrap_servers=broker, client_id="tests-audit")
    yield client
    client.close()


@pytest.fixture(scope="module")
def embedded(
    broker: str, admin: KafkaAdminClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, Path]]:
    """(topic, group, output) after a real worker embedded 2 partitions, one bad record."""
    topic, group = f"audit-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    admin.create_topics([NewTopic(topic, 2, 1)])
    out = tmp_path_factory.mktemp("audit") / "out"
    try:
        publish_json(broker, topic, corpus_records(60), partitions=2)
        publish_raw(broker, topic, [(b"k", b"{not json")])  # partition 0, offset 30
        result = run_until_end(broker, topic, group, out, "--batch-size", "8")
        assert result.returncode == 0, result.stderr[-3000:]
        yield topic, group, out
    finally:
        admin.delete_topics([t for t in (topic, f"{topic}.dlq") if t in admin.list_topics()])


def copy_of(output: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(output, copy)
    return copy


@pytest.mark.integration
def test_audit_of_a_real_run_is_clean_with_its_dead_letter(broker, embedded) -> None:
    topic, group, out = embedded

    rc, report, _ = audit_json(broker, out, group, topic)

    assert rc == 0 and report["ok"] is True
    assert (report["group"], report["topics"]) == (group, [topic])
    assert report["dead_letter_topic"] == f"{topic}.dlq"
    parts = partitions_of(report)
    assert [(p["committed"], p["rows"], p["dead_lettered"]) for p in parts.values()] == [
        (31, 30, 1),
        (30, 30, 0),
    ]
    assert all(p["missing"] == [] and p["doubled"] == [] for p in parts.values())
    assert report["totals"]["missing"] == report["totals"]["doubled"] == 0
    # The human form, from the group's own commits (no --topic).
    human = pipeline_audit(broker, "--output", str(out), "--group", group)
    assert human.returncode == 0, human.stderr
    assert human.stdout.strip().splitlines()[-1].startswith("audit OK")


@pytest.mark.integration
def test_a_deleted_segment_is_listed_as_missing(broker, embedded, tmp_path) -> None:
    topic, group, out = embedded
    copy = copy_of(out, tmp_path)
    victim = segments_by_partition(copy)[(topic, 1)][1]
    lost = sorted(o for t, p, o in output_rows(copy) if p == 1)
    info = read_info(victim)
    victim.path.unlink()

    rc, report, _ = audit_json(broker, copy, group, topic)

    assert rc == 1 and report["ok"] is False
    expected = [[info.first, info.last]]
    assert [o for o in lost if info.first <= o <= info.last]  # it held rows
    assert partitions_of(report)[1]["missing"] == expected
    assert partitions_of(report)[1]["missing_count"] == info.last - info.first + 1
    assert partitions_of(report)[0]["missing"] == []
    assert report["totals"]["missing"] == info.last - info.first + 1


@pytest.mark.integration
def test_a_segment_copied_under_a_legacy_name_is_doubled(broker, embedded, tmp_path) -> None:
    topic, group, out = embedded
    copy = copy_of(out, tmp_path)
    original = segments_by_partition(copy)[(topic, 0)][0]
    info = read_info(original)
    legacy = original.path.with_name(f"{topic}-p00000-{info.first:020d}-{info.last:020d}.parquet")
    shutil.copyfile(original.path, legacy)

    rc, report, _ = audit_json(broker, copy, group, topic)

    assert rc == 1 and report["ok"] is False
    row_offsets = pq.read_table(original.path, columns=["offset"])["offset"].to_pylist()
    assert partitions_of(report)[0]["doubled"] == [list(r) for r in runs(np.array(row_offsets))]
    assert partitions_of(report)[0]["missing"] == []
    assert partitions_of(report)[1]["doubled"] == []


@pytest.mark.integration
def test_without_the_dead_letter_topic_the_bad_record_is_missing(broker, embedded) -> None:
    topic, group, out = embedded

    rc, report, _ = audit_json_with_dlq(broker, out, group, topic, f"{topic}-no-such-dlq")

    assert rc == 1
    assert partitions_of(report)[0]["missing"] == [[30, 30]]  # the record Kafka still holds
    assert any("does not exist" in w for w in report["warnings"])


def audit_json_with_dlq(
    broker: str, output: Path, group: str, topic: str, dlq: str
) -> tuple[int, dict[str, Any], str]:
    result = pipeline_audit(
        broker,
        *("--output", str(output), "--group", group, "--topic", topic),
        *("--dlq-topic", dlq, "--json"),
    )
    return result.returncode, json.loads(result.stdout), result.stderr


@pytest.mark.integration
def test_operational_errors_use_their_own_exit_codes(broker, embedded, tmp_path) -> None:
    topic, group, out = embedded
    missing_topic = pipeline_audit(
        broker, "--output", str(out), "--group", group, "--topic", f"{topic}-nope"
    )
    assert missing_topic.returncode == 66 and missing_topic.stderr.startswith("error:")
    not_an_output = pipeline_audit(broker, "--output", str(tmp_path), "--group", group)
    assert not_an_output.returncode == 64 and "no vectors/ folder" in not_an_output.stderr
    unreachable = pipeline_audit(
        "127.0.0.1:1", "--output", str(out), "--group", group, "--topic", topic
    )
    assert unreachable.returncode == 69 and "127.0.0.1:1" in unreachable.stderr
    usage = pipeline_audit(broker, "--output", str(out))  # no --group
    assert usage.returncode == 64


def publish_transactions(broker: str, topic: str, batches: int, per_batch: int) -> int:
    """Every other transaction aborted (after its records reached the broker)."""
    producer = KafkaProducer(bootstrap_servers=broker, transactional_id=f"tx-{topic}")
    producer.init_transactions()
    sent = 0
    for batch in range(batches):
        producer.begin_transaction()
        for i in range(per_batch):
            value = json.dumps({"id": f"{batch}-{i}", "text": f"transaction {batch} item {i}"})
            producer.send(topic, value.encode(), partition=0)
        producer.flush()
        if batch % 2:
            producer.abort_transaction()
        else:
            producer.commit_transaction()
            sent += per_batch
    producer.close()
    return sent


@pytest.mark.integration
def test_transaction_markers_and_aborted_records_are_not_missing(
    broker, admin, make_topic, group_id, tmp_path
) -> None:
    topic = make_topic(partitions=1)
    committed_records = publish_transactions(broker, topic, batches=8, per_batch=5)
    out = tmp_path / "out"
    result = run_until_end(broker, topic, group_id, out, "--batch-size", "4")
    assert result.returncode == 0, result.stderr[-3000:]

    rc, report, _ = audit_json(broker, out, group_id, topic)

    [partition] = report["partitions"]
    assert rc == 0 and report["ok"] is True, report
    assert partition["committed"] == 8 * 6  # 40 records + 8 markers
    assert partition["rows"] == committed_records == 20
    # 20 aborted records and 8 markers, found by reading only what rows do not hold.
    assert partition["without_record"] == 28 and partition["missing"] == []

    # A lost segment is missing its real records only, never the markers.
    victim = segments_by_partition(out)[(topic, 0)][0]
    held = pq.read_table(victim.path, columns=["offset"])["offset"].to_pylist()
    victim.path.unlink()
    rc, report, _ = audit_json(broker, out, group_id, topic)
    assert rc == 1
    assert report["partitions"][0]["missing"] == [list(r) for r in runs(np.array(held))]


@pytest.mark.integration
def test_header_keys_that_are_not_utf8_stop_neither_the_worker_nor_the_audit(
    broker, make_topic, group_id, tmp_path
) -> None:
    """kafka-python's own decoder fails a whole batch on such a key: the worker stopped at
    that record at every restart, and an audit reading it back failed."""
    topic = make_topic(partitions=2)
    records = corpus_records(60)
    publish_with_keys_not_utf8(broker, topic, records, partitions=2)
    out = tmp_path / "out"

    result = run_until_end(broker, topic, group_id, out, "--batch-size", "8")

    assert result.returncode == 0, result.stderr[-3000:]
    rows = output_rows(out)
    assert sorted(rows) == [(topic, p, o) for p in (0, 1) for o in range(30)]
    texts = {
        r["id"]: r["text"]
        for path in sorted(vectors_dir(out).glob("*.parquet"))
        for r in pq.read_table(path, columns=["id", "text"]).to_pylist()
    }
    assert texts == {r["id"]: r["text"] for r in records}
    # The audit reads a lost segment's records back from Kafka, the keys among them.
    victim = segments_by_partition(out)[(topic, 0)][0]
    held = pq.read_table(victim.path, columns=["offset"])["offset"].to_pylist()
    assert held[0] == 0  # offset 0 carries such a key (record 0)
    victim.path.unlink()
    rc, report, stderr = audit_json(broker, out, group_id, topic)
    assert rc == 1, stderr
    assert partitions_of(report)[0]["missing"] == [[held[0], held[-1]]]
    assert partitions_of(report)[1]["missing"] == []
