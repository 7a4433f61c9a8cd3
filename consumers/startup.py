"""What a worker checks and opens before it joins its group.

The cluster and the output are checked before the group is joined (a group that
consumed partitions this output holds nothing of is refused: starting there would
leave out every record before them), then the consumer is made and subscribed, and
the tokenizer processes started; the model, loading meanwhile, is waited for in
between (consumers.worker).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka.coordinator.assignors.cooperative_sticky import CooperativeStickyAssignor

from consumers.partitions import Listener, Ownership
from consumers.tokenize_process import TokenizerPool
from pipeline.core.config import WorkerConfig
from pipeline.core.errors import OutputError
from pipeline.core.host import usable_cpus
from pipeline.core.layout import segments_by_partition
from pipeline.core.progress import Progress
from pipeline.core.records import RecordParser
from pipeline.kafka import cluster, internals, record_batches
from pipeline.model.chunking import Chunker, chunker_for
from pipeline.model.embedder import Embedder, tokenizer_choice
from sinks.identity import check_output_mode, check_output_model, check_output_rows
from sinks.parquet import ParquetSink
from sinks.segments import pending_notes

log = logging.getLogger(__name__)


@dataclass
class Preflight:
    """What the checks read: the group's commits and, in bulk mode, the end offsets
    taken at start and the progress bar."""

    committed: dict[TopicPartition, int]
    end_targets: dict[TopicPartition, int]
    progress: Progress | None


def preflight(cfg: WorkerConfig, admin: Any) -> Preflight:
    """Checks the cluster and the output before the group is joined."""
    partitions = cluster.partitions_of(admin, cfg.kafka, cfg.topics)
    cluster.ensure_topic(admin, cfg.kafka, cfg.dead_letter_topic)
    end_targets: dict[TopicPartition, int] = {}
    with cluster.offsets_consumer(cfg.kafka) as reader:
        beginnings = cluster.beginning_offsets(reader, cfg.kafka, partitions)
        if cfg.input.until_end:
            end_targets = cluster.end_offsets(reader, cfg.kafka, partitions)
    committed = cluster.group_offsets(admin, cfg.kafka, cfg.group)
    if not cfg.input.from_committed:
        check_fresh_output(cfg, partitions, committed, beginnings)
    progress = None
    if cfg.input.until_end:
        remaining = remaining_to(end_targets, committed)
        log.info("bulk mode: %d records to the end of %d partition(s)", remaining, len(partitions))
        progress = Progress("embedding", remaining, enabled=cfg.progress)
    return Preflight(committed, end_targets, progress)


def remaining_to(targets: dict[TopicPartition, int], committed: dict[TopicPartition, int]) -> int:
    return sum(max(0, end - committed.get(tp, 0)) for tp, end in targets.items())


def check_fresh_output(
    cfg: WorkerConfig,
    partitions: list[TopicPartition],
    committed: dict[TopicPartition, int],
    beginnings: dict[TopicPartition, int],
) -> None:
    """Refuses a group that consumed partitions of which the output holds nothing."""
    written = set(segments_by_partition(cfg.output, cfg.topics))
    written |= {(n.topic, n.partition) for n in pending_notes(cfg.output)}
    skipped = [
        f"{tp.topic}[{tp.partition}]@{committed[tp]}"
        for tp in partitions
        if committed.get(tp, 0) > beginnings.get(tp, 0) and (tp.topic, tp.partition) not in written
    ]
    if skipped:
        raise OutputError(
            f"group {cfg.group} has committed offsets ({', '.join(skipped)}) but "
            f"{cfg.output} holds no output for those partitions, so starting there would "
            "leave out every record before them. Give a new --group to embed the topics "
            "from the beginning, point --output at the group's existing output, or pass "
            "--from-committed to start this output at the group's offsets."
        )


def make_consumer(
    cfg: WorkerConfig, ownership: Ownership, revoke_timeout_s: float
) -> KafkaConsumer:
    """The group consumer, subscribed; its rebalances go to `ownership` (consumers.partitions)."""
    consumer = cluster.build_client(
        KafkaConsumer,
        cfg.kafka,
        group_id=cfg.group,
        enable_auto_commit=False,
        # Every assigned partition is sought explicitly (consumers.partitions);
        # an offset that retention removed is handled, never silently reset.
        auto_offset_reset="none",
        isolation_level="read_committed",
        # Moving a partition revokes only that partition: the others keep
        # their in-flight work through a member joining or leaving.
        partition_assignment_strategy=[CooperativeStickyAssignor],
        max_poll_records=cfg.batching.batch_size,
        max_poll_interval_ms=cfg.liveness.max_poll_interval_ms,
        session_timeout_ms=cfg.liveness.session_timeout_ms,
        # A member learns of a rebalance at its next heartbeat: every second, so that
        # workers started together settle in a few seconds, not a few rounds of three.
        heartbeat_interval_ms=max(100, min(1000, cfg.liveness.session_timeout_ms // 3)),
        # Bounds the fetch buffers: part of the worker's memory ceiling.
        fetch_max_bytes=16 * 1024 * 1024,
        max_partition_fetch_bytes=2 * 1024 * 1024,
        **cluster.client_kwargs(cfg.kafka),
    )
    record_batches.install(consumer)
    internals.check(consumer)
    internals.track_heartbeats(consumer)  # the write stage's lease (consumers.stages)
    internals.lose_partitions_on_reset(consumer)
    consumer.subscribe(list(cfg.topics), listener=Listener(ownership, revoke_timeout_s))
    # A metadata refresh before the first poll: kafka-python snapshots the
    # subscribed topics' partitions on metadata updates, and a first join with
    # an empty snapshot is followed by a needless second rebalance.
    cluster.retrying(consumer.topics, "reading topic metadata", cfg.kafka)
    return consumer


def output_sink(cfg: WorkerConfig, embedder: Embedder) -> tuple[ParquetSink, Chunker]:
    """The segment writer, once the output is known to take this worker's rows: one
    output holds one model's vectors, one write mode, one chunking; and the chunker,
    which refuses windows past the model's length."""
    check_output_model(cfg.output, embedder.info)
    check_output_mode(cfg.output, upsert=cfg.documents is not None)
    rows = check_output_rows(cfg.output, cfg.chunking)
    chunker = chunker_for(embedder, cfg.chunking)
    sink = ParquetSink(cfg.output, embedder.info, cfg.documents, rows, cfg.chunking)
    return sink, chunker


def tokenizer_pool(
    cfg: WorkerConfig, embedder: Embedder, parser: RecordParser
) -> TokenizerPool | None:
    """The tokenizer processes (consumers.tokenize_process), not waited for: they get
    ready while the group is joined. None where they are off."""
    choice = cfg.model.tokenizer_process
    if choice == "off" or (choice == "auto" and usable_cpus() < 2):
        return None
    # As many as the plan has tokenizer threads beside a GPU; on the CPU one, as the
    # model takes the other cores.
    count = cfg.model.tokenizer_processes or (
        embedder.tokenizer_threads if embedder.info.device == "cuda" else 1
    )
    return TokenizerPool(
        count,
        embedder.tokenizer_json(),
        embedder.info.max_length,
        parser,
        embedder.info.document_prompt or "",
        fast_path=tokenizer_choice() == "auto",
        split_special_tokens=embedder.split_special_tokens,
        chunking=cfg.chunking,
    )
