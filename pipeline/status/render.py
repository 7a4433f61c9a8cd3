"""The human form of a status report: a header line, then one aligned row per partition."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.core.tables import align


def render_table(status: Mapping[str, Any]) -> str:
    lines = [_header(status)]
    with_output = status.get("output") is not None
    columns = ["TOPIC", "PARTITION", "COMMITTED", "END", "LAG", "LAG_S", "OWNER", "VERDICT"]
    if with_output:
        columns += ["ROWS", "INDEX", "MISMATCH"]
    table = [columns] + [_cells(row, with_output) for row in status["partitions"]]
    if any(row.get("tier") for row in status["partitions"]):  # pipeline run --backfill-topic
        table[0].append("TIER")
        for cells, row in zip(table[1:], status["partitions"], strict=True):
            cells.append(_tier_cell(row))
    lines.extend(align(table, right={1, 2, 3, 4, 5, 8, 9}))
    lines.extend(f"warning: {w}" for w in status.get("warnings", []))
    return "\n".join(lines)


def _header(status: Mapping[str, Any]) -> str:
    dead = status.get("dead_letter") or {}
    dead_count = dead.get("records")
    throughput = status.get("throughput")
    parts = [
        f"group {status['group']}",
        f"state {status.get('state', '-')}",
        f"members {len(status.get('members', []))}",
        f"total lag {status['total_lag']}",
        f"lag {duration(status.get('max_lag_seconds'))}",
        f"throughput {'-' if throughput is None else f'{throughput:.1f}'} rec/s",
        f"ETA {duration(status.get('eta_seconds'))}",
        f"verdict {status.get('verdict', '-')}",
        f"dead-letter {'-' if dead_count is None else dead_count} ({dead.get('topic', '-')})",
    ]
    return "  ".join(parts)


def _cells(row: Mapping[str, Any], with_output: bool) -> list[str]:
    owner = row.get("owner")
    cells = [
        row["topic"],
        str(row["partition"]),
        _dash(row["committed"]),
        str(row["end"]),
        str(row["lag"]),
        "-" if row.get("lag_seconds") is None else f"{row['lag_seconds']:.1f}",
        "-" if not owner else f"{owner['client_id']}@{owner['host']}",
        row.get("verdict", "-"),
    ]
    if with_output:
        mismatch = row.get("mismatch") or ""
        cells += [_dash(row.get("rows")), _dash(row.get("index_entries")), mismatch]
    return cells


def _tier_cell(row: Mapping[str, Any]) -> str:
    tier = row.get("tier") or "-"
    return f"{tier} (waits for nearline)" if row.get("waiting") else tier


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def duration(seconds: float | None) -> str:
    """`42.0s`, `1m35s`, `2h05m`; `-` when unknown."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
