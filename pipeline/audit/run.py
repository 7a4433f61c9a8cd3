"""`run_audit`: the audit of one consumer group's output, as a JSON-able dict."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kafka import TopicPartition

from pipeline.audit.accounting import audit_partition
from pipeline.audit.kafka_reads import STALL_S, DeadLetters, kafka_scan, read_dead_letters
from pipeline.audit.ranges import Key
from pipeline.audit.report import audit_report
from pipeline.audit.rows import read_output_rows
from pipeline.core.config import KafkaSettings
from pipeline.core.errors import ConfigError, TopicMissing
from pipeline.core.layout import describe, has_vectors
from pipeline.kafka import cluster, record_batches
from sinks.segments import pending_notes
from sinks.view import ViewStore, has_view


def run_audit(
    kafka: KafkaSettings,
    output: Path,
    group: str,
    topics: Sequence[str] | None = None,
    *,
    dlq_topic: str | None = None,
    stall_s: float = STALL_S,
) -> dict[str, Any]:
    """Audits `output` against the committed offsets of `group`; one JSON-able dict."""
    if not group.strip():
        raise ConfigError("give the consumer group to audit (--group)")
    if not has_vectors(output):
        raise ConfigError(
            f"{describe(output)} is not an output directory (it has no vectors/ folder)"
        )
    warnings: list[str] = []
    with cluster.admin_client(kafka) as admin:
        commits = cluster.group_commits(admin, kafka, group)
        committed = {(tp.topic, tp.partition): meta.offset for tp, meta in commits.items()}
        names = resolve_topics(group, topics, committed)
        # A tiered worker's dead letters go to its (first) nearline topic's .dlq.
        nearline = {tp.topic for tp, meta in commits.items() if is_nearline(meta)}
        dead_topic = dlq_topic or f"{next((t for t in names if t in nearline), names[0])}.dlq"
        described = cluster.describe_partitions(admin, kafka, [*names, dead_topic])
    names = present_topics(names, described, named=topics is not None, warnings=warnings)
    keys = [(t, p) for t in names for p in described[t] or []]
    rows = read_output_rows(output, names)
    warnings.extend(rows.warnings)
    with cluster.offsets_consumer(
        kafka, fetch_max_wait_ms=100, auto_offset_reset="earliest", metrics_enabled=False
    ) as consumer:
        # The worker's decoder: a record it reads (a header key that is not UTF-8
        # among them) must not stop the audit that checks it.
        record_batches.install(consumer)
        dead = read_dead_letters(
            consumer, kafka, dead_topic, described.get(dead_topic), names, stall_s
        )
        tps = [TopicPartition(*key) for key in keys]
        starts = cluster.beginning_offsets(consumer, kafka, tps)
        ends = cluster.end_offsets(consumer, kafka, tps)
        scan = kafka_scan(consumer, kafka, stall_s)
        audits = [
            audit_partition(
                key,
                committed.get(key),
                starts[tp],
                ends[tp],
                rows.rows_of(key),
                dead.of(key),
                rows.coverage(key, committed.get(key)),
                scan,
                rows.purged_of(key),
                rows.chunk_rows.get(key),
                rows.bad_chunks_of(key),
                rows.chunk_problems.get(key, ()),
            )
            for key, tp in zip(keys, tps, strict=True)
        ]
    warnings.extend(_dead_letter_warnings(dead))
    warnings.extend(_quarantine_warnings(output, names))
    warnings.extend(_document_warnings(output))
    return audit_report(group, names, output, dead, audits, warnings)


def is_nearline(commit: Any) -> bool:
    """Whether a commit's metadata names the nearline tier (consumers.tiers)."""
    from consumers.tiers import NEARLINE, tier_from_metadata

    return tier_from_metadata(getattr(commit, "metadata", None)) == NEARLINE


def resolve_topics(
    group: str, topics: Sequence[str] | None, committed: Mapping[Key, int]
) -> list[str]:
    """The named topics (deduplicated), else the topics the group has commits for."""
    if topics is not None:
        names = list(dict.fromkeys(t for t in topics if t))
        if not names:
            raise ConfigError("give at least one --topic")
        return names
    names = sorted({topic for topic, _ in committed})
    if not names:
        # The user named a group with nothing to report: a usage error (64), not a bug (70).
        raise ConfigError(
            f"consumer group {group!r} has no committed offsets (it does not exist or "
            "never committed); check --group, or name the topics with --topic"
        )
    return names


def present_topics(
    names: Sequence[str],
    described: Mapping[str, list[int] | None],
    *,
    named: bool,
    warnings: list[str],
) -> list[str]:
    """The topics that exist; TopicMissing for a named one that does not, else a warning."""
    missing = [t for t in names if described.get(t) is None]
    if missing and named:
        raise TopicMissing(
            f"topic {', '.join(missing)} does not exist; "
            "create it (pipeline topics create) or check --topic"
        )
    # Commits for a topic deleted since: nothing left to check against.
    warnings.extend(f"group has offsets for {t}, which no longer exists" for t in missing)
    present = [t for t in names if described.get(t) is not None]
    if not present:
        raise TopicMissing(f"none of the group's topics exist any more: {', '.join(missing)}")
    return present


def _dead_letter_warnings(dead: DeadLetters) -> list[str]:
    found = []
    if not dead.exists:
        found.append(f"dead-letter topic {dead.topic} does not exist: no dead letters counted")
    if dead.without_source:
        found.append(f"{dead.without_source} record(s) in {dead.topic} have no source.* headers")
    return found


def _document_warnings(output: Path) -> list[str]:
    """Upsert mode: document keys the current view saw in more than one partition."""
    if not has_view(output):
        return []
    state = ViewStore(output).state()
    if not state.cross_partition:
        return []
    return [
        f"{state.cross_partition} document key(s) were seen in more than one partition "
        f"({state.cross_partition_example!r} first): their latest version is decided by record "
        "timestamp, not offset; key records by document (docs/documents.md: ordering)"
    ]


def _quarantine_warnings(output: Path, topics: Sequence[str]) -> list[str]:
    return [
        f"damaged segment {note.file} ({note.topic}[{note.partition}] from offset {note.first}) "
        "is in quarantine, waiting for a worker to read its range again"
        for note in pending_notes(output)
        if note.topic in topics
    ]
