"""Damaged outputs, mended at start-up before the worker joins its group.

1. Every segment's footer is checked (the file's last few KiB); a damaged one
   is moved into `DIR/quarantine/` with a note of the range it held
   (`sinks.segments.quarantine`), and counted.
2. Each pending note's range is read again from Kafka, embedded, and written
   as a new segment under the same name (create-if-absent: when several
   workers start together, one of them writes it). Its bad records are not
   dead-lettered again: they were, before the damaged segment was published.
   A range Kafka no longer retains is reported on one error line naming the
   file and the offsets, and the note is marked lost (`pipeline audit` lists
   the offsets); the worker goes on.

A damaged last segment whose range cannot be known yet (nothing after it, no
commit past it) needs no repair here: its partition's next owner starts at its
first offset, since the segments before it end there.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import kafka.errors as kerrors
from kafka import KafkaConsumer, TopicPartition

from pipeline.core.config import KafkaSettings, WorkerConfig
from pipeline.core.documents import Deletion, paired
from pipeline.core.errors import OutputError, PipelineError
from pipeline.core.host import call_on_fresh_thread
from pipeline.core.layout import (
    SegmentFile,
    SegmentKey,
    TopicPartitionKey,
    describe,
    is_local,
    segments_by_partition,
)
from pipeline.core.records import GoodRecord, RecordParser, SourceRecord
from pipeline.kafka import cluster, record_batches
from pipeline.model.chunking import chunker_for, shaped_rows
from pipeline.model.embedder import Embedder
from sinks.parquet import ParquetSink
from sinks.segments import (
    DamagedSegment,
    QuarantineNote,
    pending_notes,
    quarantine,
    read_info,
    save_note,
)

log = logging.getLogger(__name__)

_READ_DEADLINE_S = 120.0
_FOOTER_THREADS = 16


@dataclass
class RepairReport:
    quarantined: int = 0
    repaired: int = 0
    lost: int = 0


def repair_outputs(
    config: WorkerConfig,
    embedder: Embedder,
    parser: RecordParser,
    sink: ParquetSink,
    committed: dict[TopicPartitionKey, int],
) -> RepairReport:
    report = RepairReport()
    report.quarantined = quarantine_damaged(config)
    for note in pending_notes(config.output):
        if note.topic not in config.topics:
            continue
        outcome = _repair(config, embedder, parser, sink, note, committed)
        if outcome == "repaired":
            report.repaired += 1
        elif outcome == "lost":
            report.lost += 1
    return report


def quarantine_damaged(config: WorkerConfig) -> int:
    """Checks the footer of every segment; moves damaged ones aside.

    Every segment, not only those past the index's coverage: a segment damaged
    after the index read it (a disk error, a partial restore or copy) holds rows
    that the index still has but the outputs no longer do, and only reading its
    range again from Kafka mends that. A footer read is the file's last few KiB.
    """
    segments = [
        segment
        for partition in segments_by_partition(config.output, config.topics).values()
        for segment in partition
    ]
    # An object store answers each footer in a round trip: ask many at once.
    threads = 1 if is_local(config.output) else _FOOTER_THREADS
    with ThreadPoolExecutor(threads, thread_name_prefix="footers") as pool:
        found = list(pool.map(_damage, segments))
    moved = 0
    for damaged in found:
        if damaged is not None and quarantine(config.output, damaged.segment, damaged.reason):
            moved += 1
    return moved


def _damage(segment: SegmentFile) -> DamagedSegment | None:
    try:
        read_info(segment)
    except FileNotFoundError:
        return None  # moved aside by another worker starting together
    except DamagedSegment as damaged:
        return damaged
    return None


def _repair(
    config: WorkerConfig,
    embedder: Embedder,
    parser: RecordParser,
    sink: ParquetSink,
    note: QuarantineNote,
    committed: dict[TopicPartitionKey, int],
) -> str:
    key = SegmentKey(note.topic, note.partition, note.first)
    if sink.exists(key) or _covered(config, note):
        return _close(config, note, "repaired")  # its range was written again meanwhile
    last = _range_end(config, note, committed)
    if last is None:
        return "pending"
    tp = TopicPartition(note.topic, note.partition)
    with cluster.offsets_consumer(config.kafka) as reader:
        record_batches.install(reader)  # decodes the range as the worker first did
        beginning = cluster.beginning_offsets(reader, config.kafka, [tp])[tp]
        if note.first < beginning:
            log.error(
                "damaged segment %s held %s[%d] offsets %d..%d, which Kafka no longer retains "
                "(the partition now starts at %d): those records are lost from the output; "
                "restore the file from a backup into %s/vectors to recover them",
                note.file,
                note.topic,
                note.partition,
                note.first,
                last,
                beginning,
                describe(config.output),
            )
            return _close(config, note, "lost")
        sources = read_range(reader, config.kafka, tp, note.first, last)
    rows, ids, _ = shaped_rows(
        embedder, chunker_for(embedder, config.chunking), [parser.parse(s) for s in sources]
    )
    paired_rows = paired(rows, ids, sink.documents)
    good = [p for p, _ in paired_rows if isinstance(p, GoodRecord)]
    tokens = [len(i) for p, i in paired_rows if isinstance(p, GoodRecord) and i is not None]
    deletions = [p for p, _ in paired_rows if isinstance(p, Deletion)]
    # A thread of its own, like the model load: the embed stage keeps the only OpenMP team.
    vectors = call_on_fresh_thread(lambda: embedder.embed([g.text for g in good]), "repair")
    staged = sink.stage(
        key, last, good, vectors, consumed=len(sources), deletions=deletions, tokens=tokens
    )
    published = sink.publish(staged)
    log.warning(
        "damaged segment %s: %s[%d] offsets %d..%d read again from Kafka and %s (%d rows)",
        note.file,
        note.topic,
        note.partition,
        note.first,
        last,
        "written" if published else "written by another worker",
        len(good),
    )
    return _close(config, note, "repaired")


def _range_end(
    config: WorkerConfig, note: QuarantineNote, committed: dict[TopicPartitionKey, int]
) -> int | None:
    """The last offset the damaged segment held, if it can be known."""
    if note.last is not None:
        return note.last
    key = (note.topic, note.partition)
    later = [
        s.key.first
        for s in segments_by_partition(config.output, [note.topic]).get(key, [])
        if s.key.first > note.first
    ]
    # Damaged neighbours moved aside too: the segments tiled, so this one ended before them.
    later += [
        other.first
        for other in pending_notes(config.output)
        if (other.topic, other.partition) == key and other.first > note.first
    ]
    if later:
        return min(later) - 1
    # Nothing after it: the group's commit says how far it was published.
    commit = committed.get(key)
    if commit is not None and commit > note.first:
        return commit - 1
    return None


def _covered(config: WorkerConfig, note: QuarantineNote) -> bool:
    """Whether a segment starting before the note's range already covers its first offset
    (a neighbour's repair, or a new owner reading on from before it)."""
    key = (note.topic, note.partition)
    before = [
        s
        for s in segments_by_partition(config.output, [note.topic]).get(key, [])
        if s.key.first < note.first
    ]
    if not before:
        return False
    try:
        return read_info(before[-1]).last >= note.first
    except (FileNotFoundError, DamagedSegment):
        return False


def _close(config: WorkerConfig, note: QuarantineNote, outcome: str) -> str:
    note.repaired = outcome == "repaired"
    note.lost = outcome == "lost"
    save_note(config.output, note)
    return outcome


def read_range(
    consumer: KafkaConsumer, kafka: KafkaSettings, tp: TopicPartition, first: int, last: int
) -> list[SourceRecord]:
    """Every committed record of `tp` from `first` to `last`, with a read_committed consumer."""
    consumer.assign([tp])
    consumer.seek(tp, first)
    records: list[SourceRecord] = []
    deadline = time.monotonic() + _READ_DEADLINE_S
    while (consumer.position(tp, timeout_ms=5_000) or first) <= last:
        if time.monotonic() > deadline:
            raise cluster.unreachable(kafka, what=f"reading {tp.topic}[{tp.partition}] again")
        try:
            polled = consumer.poll(timeout_ms=500)
        except record_batches.UNDECODABLE as exc:
            at = consumer.position(tp, timeout_ms=0)
            where = (
                f"{tp.topic}[{tp.partition}] at offset {at}, read again to repair a damaged segment"
            )
            raise record_batches.undecodable(where, exc) from exc
        for batch in polled.values():
            records += [
                SourceRecord(r.topic, r.partition, r.offset, r.timestamp, r.key, r.value)
                for r in batch
                if first <= r.offset <= last
            ]
    return records


def decode_failure(kafka: KafkaSettings, tp: TopicPartition, position: int) -> Exception | None:
    """The decoding error fetching `tp` from `position` gives, if any (to name it)."""
    try:
        with cluster.offsets_consumer(kafka) as probe:
            record_batches.install(probe)  # the worker's decoder, so the worker's error
            probe.assign([tp])
            probe.seek(tp, position)
            for _ in range(6):
                probe.poll(timeout_ms=500, max_records=1)
    except record_batches.UNDECODABLE as exc:
        return exc
    except (kerrors.KafkaError, PipelineError):  # the broker's trouble: no diagnosis
        return None
    return None


def undecodable_at(consumer: Any, kafka: KafkaSettings, exc: Exception) -> PipelineError:
    """The one line a worker stops with at a record batch that cannot be decoded,
    naming its partition and offset where a probe finds it."""
    where = "an assigned partition"
    for tp in sorted(consumer.assignment()):
        try:
            position = consumer.position(tp, timeout_ms=0)
        except kerrors.KafkaError:
            continue
        found = None if position is None else decode_failure(kafka, tp, position)
        if found is not None:
            # The probe's own error: with several undecodable partitions the one
            # poll() raised may belong to another.
            where, exc = f"{tp.topic}[{tp.partition}] at offset {position}", found
            break
    return record_batches.undecodable(where, exc)


def after_retention(
    config: WorkerConfig, offsets: dict[TopicPartition, int]
) -> dict[tuple[str, int], int]:
    """Where partitions whose positions Kafka no longer has start again: their earliest
    retained offset (the deleted ones are logged; `pipeline audit` lists them). A
    position past a partition's end means the topic was re-created: refused."""
    tps = list(offsets)
    with cluster.offsets_consumer(config.kafka) as probe:
        beginnings = cluster.beginning_offsets(probe, config.kafka, tps)
        ends = cluster.end_offsets(probe, config.kafka, tps)
    restarts = {}
    for tp, offset in offsets.items():
        if offset >= ends[tp]:
            raise OutputError(
                f"{tp.topic}[{tp.partition}]: the outputs in {config.output} run to "
                f"offset {offset - 1} but the partition ends at {ends[tp]}: was the topic "
                "deleted and re-created? Embed it into a new --output with a new --group"
            )
        log.error(
            "%s[%d]: offsets %d..%d were deleted by retention before they were embedded; "
            "continuing at %d (pipeline audit lists them)",
            tp.topic,
            tp.partition,
            offset,
            beginnings[tp] - 1,
            beginnings[tp],
        )
        restarts[(tp.topic, tp.partition)] = beginnings[tp]
    return restarts
