"""Every bad record exactly once in the dead-letter topic.

Unit tests drive the ledger (consumers/dead_letters.py) against an in-memory
topic; the integration test runs real workers against the real broker after a
previous owner dead-lettered records and died before publishing them, and ends
with an independent count of the dead-letter topic per source offset. Workers
SIGKILLed and stalled between a batch's dead letters and its publish are the chaos
scenario `dead-letters` (tests/test_chaos.py runs a seed of it).
"""

from __future__ import annotations

import json
import random
import re
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from kafka import KafkaProducer

from consumers.dead_letters import DeadLetterLedger
from pipeline.core.config import KafkaSettings
from pipeline.core.records import BadRecord, SourceRecord
from pipeline.kafka import dead_letter
from pipeline.kafka.dead_letter import (
    DeadLetterSink,
    Scanned,
    dead_letter_headers,
    dead_letter_partition,
)
from sinks.segments import DeadLetterMark
from tests.helpers import (
    corpus_records,
    duplicates,
    output_rows,
    publish_raw,
    read_topic,
    run_until_end,
    write_segment,
)

TOPIC = "docs"
DLQ = "docs.dlq"


def bad(partition: int, offset: int) -> BadRecord:
    source = SourceRecord(TOPIC, partition, offset, 0, None, b"{not json")
    return BadRecord(source, "decode", "InvalidJson", "not JSON")


class MemoryTopic:
    """The dead-letter topic as a list per partition, for the ledger's unit tests."""

    def __init__(self, partitions: int = 1) -> None:
        self.topic = DLQ
        self.logs: dict[int, list[tuple[str, int, int]]] = {p: [] for p in range(partitions)}
        self.scans: list[tuple[int, int | None]] = []

    def partitions(self) -> int:
        return len(self.logs)

    def append(self, source: tuple[str, int, int], partitions: int | None = None) -> int:
        log = self.logs[dead_letter_partition(source[1], partitions or len(self.logs))]
        log.append(source)
        return len(log) - 1

    def send(self, records: list[BadRecord], partitions: int) -> dict[int, int]:
        highest: dict[int, int] = {}
        for record in records:
            src = record.source
            at = self.append((src.topic, src.partition, src.offset), partitions)
            home = dead_letter_partition(src.partition, partitions)
            highest[home] = max(highest.get(home, -1), at)
        return highest

    def end_offsets(self, partitions: Iterable[int]) -> dict[int, int]:
        return {p: len(self.logs[p]) for p in partitions}

    def scan(
        self, partition: int, start: int | None, sources: Iterable[tuple[str, int]]
    ) -> Scanned:
        self.scans.append((partition, start))
        wanted = set(sources)
        log = self.logs[partition]
        scanned = Scanned(partition, len(log))
        for at in range(start or 0, len(log)):
            scanned.read += 1
            topic, part, offset = log[at]
            if (topic, part) in wanted:
                scanned.found.setdefault((topic, part), {}).setdefault(offset, at)
        return scanned

    def counts(self) -> Counter[tuple[str, int, int]]:
        return Counter(source for log in self.logs.values() for source in log)


def _prepare(ledger: DeadLetterLedger, records: list[BadRecord], ranges: dict):
    plans = ledger.prepare(records, ranges)
    ledger.send(plans, plans.keys())
    return plans


def test_a_new_owner_does_not_send_what_an_earlier_owner_sent(tmp_path: Path) -> None:
    topic = MemoryTopic()
    # The earlier owner sent the dead letters of offsets 10 and 12, then died unpublished.
    topic.append((TOPIC, 0, 10))
    topic.append((TOPIC, 0, 12))
    ledger = DeadLetterLedger(topic, tmp_path)
    ledger.started({(TOPIC, 0): 10}, lambda key: 7)

    plans = _prepare(ledger, [bad(0, 10), bad(0, 12), bad(0, 15)], {(TOPIC, 0): (7, 10, 20)})

    assert [b.source.offset for b in plans[(TOPIC, 0)].send] == [15]
    assert topic.counts() == Counter({(TOPIC, 0, 10): 1, (TOPIC, 0, 12): 1, (TOPIC, 0, 15): 1})
    assert topic.scans == [(0, None)]  # no segment yet: the whole partition, once
    assert ledger.skipped == 2


def test_dead_letters_past_the_batch_pin_the_mark_until_published(tmp_path: Path) -> None:
    topic = MemoryTopic()
    for offset in (3, 25, 27):  # sent by an earlier owner, for offsets up to 27
        topic.append((TOPIC, 0, offset))
    ledger = DeadLetterLedger(topic, tmp_path)
    ledger.started({(TOPIC, 0): 0}, lambda key: 1)

    first = _prepare(ledger, [bad(0, 3)], {(TOPIC, 0): (1, 0, 19)})
    ledger.published((TOPIC, 0), 1, 19)
    # 25 and 27 lie past this segment: the next owner must read from where 25 is.
    assert first[(TOPIC, 0)].mark == DeadLetterMark(DLQ, 0, 1)
    second = _prepare(ledger, [bad(0, 25), bad(0, 27), bad(0, 30)], {(TOPIC, 0): (1, 20, 39)})
    assert [b.source.offset for b in second[(TOPIC, 0)].send] == [30]
    # Nothing of partition 0 lies past 39: the mark moves up to the topic's end as this
    # batch found it (its own dead letter, for 30, lies at 3 and later ones after it).
    assert second[(TOPIC, 0)].mark == DeadLetterMark(DLQ, 0, 3)
    assert set(topic.counts().values()) == {1}


def test_the_next_owner_reads_from_the_mark_of_the_segment_it_starts_after(
    tmp_path: Path,
) -> None:
    topic = MemoryTopic()
    for n in range(50):  # another partition's dead letters, long before
        topic.append((TOPIC, 1, n))
    topic.append((TOPIC, 0, 105))  # sent by an owner that died before publishing 100..
    write_segment(tmp_path, TOPIC, 0, 0, 99, dead_letters=DeadLetterMark(DLQ, 0, 50))
    ledger = DeadLetterLedger(topic, tmp_path)
    ledger.started({(TOPIC, 0): 100}, lambda key: 3)

    plans = _prepare(ledger, [bad(0, 105), bad(0, 106)], {(TOPIC, 0): (3, 100, 120)})

    assert topic.scans == [(0, 50)]
    assert [b.source.offset for b in plans[(TOPIC, 0)].send] == [106]
    assert topic.counts()[(TOPIC, 0, 105)] == 1


def test_a_fenced_ownership_reads_again_and_sends_nothing_twice(tmp_path: Path) -> None:
    topic = MemoryTopic()
    ledger = DeadLetterLedger(topic, tmp_path)
    key = (TOPIC, 0)
    ledger.started({key: 0}, lambda k: 1)
    _prepare(ledger, [bad(0, 4)], {key: (1, 0, 9)})  # sent; the publish then lost a race
    ledger.started({key: 0}, lambda k: 2)  # the fence: the partition is read again from 0

    plans = _prepare(ledger, [bad(0, 4)], {key: (2, 0, 9)})

    assert plans[key].send == []
    assert topic.counts()[(TOPIC, 0, 4)] == 1


def test_read_ahead_the_first_batch_finds_what_an_earlier_owner_sent(tmp_path: Path) -> None:
    topic = MemoryTopic()
    topic.append((TOPIC, 0, 10))  # sent by an owner that died before publishing
    ledger = DeadLetterLedger(topic, tmp_path)
    key = (TOPIC, 0)
    ledger.started({key: 10}, lambda k: 7)
    assert ledger.unread() == {key: 7}

    ledger.read_ahead([key])  # the write stage, idle while the first batch is embedded
    topic.append((TOPIC, 1, 3))  # another partition's, after the read: not re-read
    plans = _prepare(ledger, [bad(0, 10), bad(0, 11)], {key: (7, 10, 20)})

    assert ledger.unread() == {}
    assert topic.scans == [(0, None)]  # once, ahead; the batch's write did not read
    assert [b.source.offset for b in plans[key].send] == [11]
    assert topic.counts()[(TOPIC, 0, 10)] == 1


def test_an_ownership_renewed_during_a_read_reads_again(tmp_path: Path) -> None:
    topic = MemoryTopic()
    ledger = DeadLetterLedger(topic, tmp_path)
    key = (TOPIC, 0)
    ledger.started({key: 0}, lambda k: 1)
    scan = topic.scan

    def renewed_meanwhile(partition, start, sources):
        scanned = scan(partition, start, sources)
        # Revoked and assigned again while the read ran; then another owner of the
        # time between sent a dead letter this read did not see.
        ledger.started({key: 0}, lambda k: 2)
        topic.append((TOPIC, 0, 4))
        return scanned

    topic.scan = renewed_meanwhile
    ledger.read_ahead([key])
    topic.scan = scan

    assert ledger.unread() == {key: 2}  # the read was the old ownership's
    plans = _prepare(ledger, [bad(0, 4)], {key: (2, 0, 9)})
    assert plans[key].send == []
    assert topic.counts()[(TOPIC, 0, 4)] == 1


def test_a_revoked_ownership_plans_nothing(tmp_path: Path) -> None:
    ledger = DeadLetterLedger(MemoryTopic(), tmp_path)
    ledger.started({(TOPIC, 0): 0}, lambda k: 5)
    assert ledger.prepare([bad(0, 1)], {(TOPIC, 0): (4, 0, 9)}) == {}


def test_each_source_partition_has_one_dead_letter_partition(tmp_path: Path) -> None:
    topic = MemoryTopic(partitions=3)
    ledger = DeadLetterLedger(topic, tmp_path)
    ledger.started({(TOPIC, p): 0 for p in range(4)}, lambda k: 1)
    records = [bad(p, o) for p in range(4) for o in range(3)]
    _prepare(ledger, records, {(TOPIC, p): (1, 0, 5) for p in range(4)})
    for partition, log in topic.logs.items():
        assert {source[1] % 3 for source in log} <= {partition}
        for part in {source[1] for source in log}:  # in source order
            offsets = [o for _, p, o in log if p == part]
            assert offsets == sorted(offsets)


class RecordingProducer:
    """Stands in for kafka-python's producer: refuses a send with neither key nor value
    before serializing, as it does, then serializes the key with the configured
    serializer and keeps what would go on the wire."""

    def __init__(self, **configs) -> None:
        self.key_serializer = configs.get("key_serializer")
        self.sent: list[tuple[bytes | None, bytes | None, list]] = []

    def send(self, topic, value=None, key=None, headers=None, partition=None):
        from kafka.producer.future import FutureProduceResult, FutureRecordMetadata
        from kafka.structs import TopicPartition

        if key is None and value is None:
            raise ValueError("Need at least one: key or value")
        if self.key_serializer is not None:
            key = self.key_serializer.serialize(topic, headers, key)
        assert key is None or isinstance(key, bytes)
        self.sent.append((key, value, headers))
        result = FutureProduceResult(TopicPartition(topic, partition))
        future = FutureRecordMetadata(result, 0, -1, None, -1, -1, -1)
        result.success((len(self.sent) - 1, -1, None))
        return future

    def flush(self, timeout=None) -> None:
        pass


def test_a_record_with_neither_key_nor_value_is_dead_lettered_as_it_came(monkeypatch) -> None:
    producers: list[RecordingProducer] = []

    def build(make, kafka, **configs):
        producers.append(RecordingProducer(**configs))
        return producers[-1]

    monkeypatch.setattr(dead_letter.cluster, "build_client", build)
    sink = DeadLetterSink(KafkaSettings(), DLQ)
    keyless = BadRecord(SourceRecord(TOPIC, 0, 7, 0, None, None), "keys", "MissingDocumentKey", "")
    keyed = BadRecord(SourceRecord(TOPIC, 0, 8, 0, b"k", None), "keys", "KeyTooLong", "")
    valued = bad(0, 9)
    assert sink.send([keyless, keyed, valued], partitions=1) == {0: 2}
    (producer,) = producers
    assert [(k, v) for k, v, _ in producer.sent] == [
        (None, None), (b"k", None), (None, b"{not json"),
    ]  # fmt: skip
    assert producer.sent[0][2] == dead_letter_headers(keyless)


# -- against the real broker ---------------------------------------------------------------


def _items(n: int, seed: int, every: int = 8) -> list[tuple[bytes | None, bytes | None]]:
    """`n` records, one in `every` bad (invalid JSON)."""
    rng = random.Random(seed)
    items: list[tuple[bytes | None, bytes | None]] = []
    for i, record in enumerate(corpus_records(n, seed=seed)):
        if rng.randrange(every) == 0:
            items.append((f"bad-{i}".encode(), b'{"text": "cut off'))
        else:
            items.append((f"good-{i}".encode(), json.dumps(record).encode()))
    return items


def _dead_letter_counts(broker: str, topic: str) -> Counter[tuple[int, int]]:
    counts: Counter[tuple[int, int]] = Counter()
    for record in read_topic(broker, f"{topic}.dlq", timeout_s=30):
        headers = {k: v.decode() for k, v in record.headers}
        assert headers["source.topic"] == topic
        counts[(int(headers["source.partition"]), int(headers["source.offset"]))] += 1
    return counts


def _bad_positions(items: list, partitions: int) -> set[tuple[int, int]]:
    """Where publish_raw put the bad records (round-robin over the partitions)."""
    return {
        (n % partitions, n // partitions)
        for n, (key, _) in enumerate(items)
        if key is not None and key.startswith(b"bad-")
    }


def _send_as_an_earlier_owner(broker: str, topic: str, positions: Iterable[tuple[int, int]]):
    """What a worker that sent a batch's dead letters and died before publishing left."""
    producer = KafkaProducer(bootstrap_servers=broker, acks="all")
    for partition, offset in sorted(positions):
        source = SourceRecord(topic, partition, offset, 0, None, b'{"text": "cut off')
        headers = dead_letter_headers(BadRecord(source, "decode", "InvalidJson", "earlier"))
        producer.send(f"{topic}.dlq", value=source.value, headers=headers, partition=0)
    producer.flush(30)
    producer.close()


@pytest.mark.integration
def test_dead_letters_sent_before_a_crash_are_not_sent_again(
    broker, make_topic, group_id, tmp_path, tiny_model
):
    topic = make_topic(partitions=2)
    items = _items(400, seed=1)
    publish_raw(broker, topic, items, partitions=2)
    bad_positions = _bad_positions(items, 2)
    make_topic_named(broker, f"{topic}.dlq")
    earlier = set(sorted(bad_positions)[: len(bad_positions) // 2])
    _send_as_an_earlier_owner(broker, topic, earlier)
    out = tmp_path / "out"

    result = run_until_end(
        broker, topic, group_id, out, "--batch-size", "32", "--model", tiny_model
    )

    assert result.returncode == 0, result.stderr[-3000:]
    counts = _dead_letter_counts(broker, topic)
    assert set(counts) == bad_positions
    assert [k for k, n in counts.items() if n > 1] == []
    said = re.findall(r"dead letters: (\d+) bad record\(s\) .* earlier owner", result.stderr)
    assert sum(map(int, said)) == len(earlier)
    rows = output_rows(out)
    assert duplicates(rows) == []
    assert {(p, o) for _, p, o in rows} | bad_positions == {
        (n % 2, n // 2) for n in range(len(items))
    }

    # A second run after more records: it reads the dead-letter topic from the newest
    # segment's mark, and again sends only what no one sent.
    more = _items(200, seed=2)
    publish_raw(broker, topic, more, partitions=2)
    later = {(p, o + 200) for p, o in _bad_positions(more, 2)}
    _send_as_an_earlier_owner(broker, topic, sorted(later)[:3])
    marks = [
        DeadLetterMark.from_text(
            (pq.read_schema(f).metadata or {}).get(b"segment.dead_letters_from", b"").decode()
        )
        for f in (out / "vectors").glob("*.parquet")
    ]
    assert marks and all(m is not None and m.topic == f"{topic}.dlq" for m in marks)

    result = run_until_end(
        broker, topic, group_id, out, "--batch-size", "32", "--model", tiny_model
    )

    assert result.returncode == 0, result.stderr[-3000:]
    counts = _dead_letter_counts(broker, topic)
    assert set(counts) == bad_positions | later
    assert [k for k, n in counts.items() if n > 1] == []


@pytest.mark.integration
def test_a_null_key_null_value_dead_letter_reaches_the_broker_as_nulls(
    broker, make_topic, kafka_settings
) -> None:
    """kafka-python writes the keyless tombstone's dead letter as a true null key and
    null value, with its headers (what the unit test above assumes of the serializer)."""
    topic = make_topic(partitions=1)
    make_topic_named(broker, f"{topic}.dlq")
    sink = DeadLetterSink(kafka_settings, f"{topic}.dlq")
    try:
        source = SourceRecord(topic, 0, 3, 0, None, None)
        sent = BadRecord(source, "keys", "MissingDocumentKey", "a tombstone without a key")
        assert sink.send([sent], sink.partitions()) == {0: 0}
    finally:
        sink.close()
    (record,) = read_topic(broker, f"{topic}.dlq", timeout_s=30)
    assert (record.key, record.value) == (None, None)
    assert list(record.headers) == dead_letter_headers(sent)


def _options(model: str) -> tuple[str, ...]:
    return ("--batch-size", "32", "--model", model)


def make_topic_named(broker: str, name: str, partitions: int = 1) -> None:
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=broker)
    try:
        admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        admin.close()


def test_failpoints_pause_where_named_and_refuse_unknown_names(monkeypatch) -> None:
    from pipeline.core import failpoints
    from pipeline.core.errors import ConfigError

    monkeypatch.setenv(failpoints.ENV, "write.after_dead_letters=0.2")
    started = time.monotonic()
    failpoints.pause("write.after_dead_letters")
    assert time.monotonic() - started >= 0.2
    monkeypatch.setenv(failpoints.ENV, "write.nowhere=1")
    with pytest.raises(ConfigError, match=r"unknown failpoint 'write\.nowhere'"):
        failpoints.pause("write.after_dead_letters")
