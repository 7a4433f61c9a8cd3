"""The audit's report (`audit_report`, one JSON-able dict) and its human form."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.audit.accounting import PartitionAudit
from pipeline.audit.kafka_reads import DeadLetters
from pipeline.audit.ranges import count, describe_ranges
from pipeline.core.tables import align


def audit_report(
    group: str,
    topics: Sequence[str],
    output: Path,
    dead: DeadLetters,
    audits: Sequence[PartitionAudit],
    warnings: Sequence[str],
) -> dict[str, Any]:
    damaged = [d.to_dict() for a in audits for d in a.coverage.damaged]
    totals = {
        "partitions": len(audits),
        "rows": sum(a.rows for a in audits),
        "dead_lettered": sum(a.dead_lettered for a in audits),
        "purged": sum(a.purged for a in audits),
        "missing": sum(count(a.missing) for a in audits),
        "doubled": sum(count(a.doubled) for a in audits),
        "dead_letter_repeats": sum(count(a.dead_letter_repeats) for a in audits),
        "unverifiable": sum(a.unverifiable for a in audits),
        "without_record": sum(a.without_record for a in audits),
        "damaged_files": len(damaged),
    }
    if any(a.chunked for a in audits):  # a chunked output: its rows and broken records
        totals["chunk_rows"] = sum(a.chunk_rows for a in audits)
        totals["bad_chunks"] = sum(count(a.bad_chunks) for a in audits)
    return {
        "group": group,
        "topics": list(topics),
        "output": str(output),
        "dead_letter_topic": dead.topic,
        "partitions": [a.to_dict() for a in audits],
        "totals": totals,
        "damaged": damaged,
        "warnings": list(warnings),
        "ok": all(a.ok for a in audits),
    }


# --------------------------------------------------------------------------- rendering


def render_audit(report: Mapping[str, Any]) -> str:
    """The human form: one row per partition, then damaged files, warnings and the verdict."""
    columns = [
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
    table = [columns] + [_audit_cells(p) for p in report["partitions"]]
    chunked = any(p.get("chunked") for p in report["partitions"])
    if chunked:  # ROWS counts records; CHUNKS their rows
        table[0] += ["CHUNKS", "BAD_CHUNKS"]
        for cells, partition in zip(table[1:], report["partitions"], strict=True):
            cells += _chunk_cells(partition)
    lines = align(table, right={1, 2, 3, 4, 7, 9} if chunked else {1, 2, 3, 4, 7})
    lines.extend(
        f"chunks: {p['topic']}[{p['partition']}] offset {problem['offset']}: {problem['problem']}"
        for p in report["partitions"]
        for problem in p.get("chunk_problems", [])
    )
    lines.extend(f"damaged: {d['file']} ({d['reason']})" for d in report.get("damaged", []))
    lines.extend(f"warning: {w}" for w in report.get("warnings", []))
    lines.append(_verdict_line(report))
    return "\n".join(lines)


def _audit_cells(partition: Mapping[str, Any]) -> list[str]:
    def ranges(name: str) -> str:
        return describe_ranges([tuple(r) for r in partition[name]])  # type: ignore[misc]

    committed = partition["committed"]
    return [
        partition["topic"],
        str(partition["partition"]),
        "-" if committed is None else str(committed),
        str(partition["rows"]),
        str(partition["dead_lettered"]),
        ranges("missing"),
        ranges("doubled"),
        str(partition["unverifiable"]),
        ranges("dead_letter_repeats"),
    ]


def _chunk_cells(partition: Mapping[str, Any]) -> list[str]:
    if not partition.get("chunked"):
        return ["-", "-"]
    bad = describe_ranges([tuple(r) for r in partition["bad_chunks"]])  # type: ignore[misc]
    return [str(partition["chunk_rows"]), bad]


def _verdict_line(report: Mapping[str, Any]) -> str:
    totals = report["totals"]
    head = "audit OK" if report["ok"] else "audit FAILED"
    # A chunked output's rows are chunks: its records are counted, and their chunks.
    rows = (
        f"{totals['rows']} records in {totals['chunk_rows']} chunk rows, "
        f"{totals['bad_chunks']} with chunks incomplete or doubled, "
        if "chunk_rows" in totals
        else f"{totals['rows']} rows, "
    )
    return (
        f"{head}: group {report['group']}, {totals['partitions']} partition(s), "
        + rows
        + f"{totals['dead_lettered']} dead-lettered, "
        + (f"{totals['purged']} purged, " if totals.get("purged") else "")
        + f"{totals['missing']} missing, {totals['doubled']} doubled, "
        f"{totals['dead_letter_repeats']} dead-lettered twice, "
        f"{totals['unverifiable']} unverifiable, {totals['damaged_files']} damaged file(s)"
    )
