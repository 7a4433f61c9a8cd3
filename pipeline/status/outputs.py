"""What the output directory says per partition, for `pipeline status --output`.

Footers only (cheap): rows, files, how far the segments reach, and whether they
tile every offset below the committed one (`pipeline.audit.output_coverage`,
the same check `pipeline audit` makes), plus the index's entry counts and, in
upsert mode, how far the current view has applied each partition. A
partition whose segments leave a gap below the committed offset, or overlap,
gets the MISMATCH verdict; an index that lags its rows is only reported (the
index is synced some seconds after the segments are published).

Rows are what the index holds one vector each of: in a chunked output (`pipeline
run --chunk-tokens N`) a row per chunk, so `rows` and the index's entries count
chunks, and neither is compared with a count of offsets (`"chunked": true` says so).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.audit.coverage import Coverage, check_coverage, output_coverage
from pipeline.core.layout import Output, describe, has_vectors
from sinks.index.files import index_files
from sinks.view import ViewStore, has_view

Key = tuple[str, int]


@dataclass(frozen=True)
class PartitionOutput:
    coverage: Coverage
    index_entries: int | None
    # Upsert mode: the last offset the current view has applied (None: nothing yet);
    # absent in append mode.
    view_through: int | None = None
    upsert: bool = False

    @property
    def mismatched(self) -> bool:
        """The segments do not account for every committed offset, or overlap."""
        return not self.coverage.ok

    def fields(self) -> dict[str, Any]:
        """The status row's output columns."""
        coverage = self.coverage
        return {
            "rows": coverage.rows,
            "files": coverage.files,
            "covered_through": coverage.covered_through,
            "index_entries": self.index_entries,
            "missing": [list(r) for r in coverage.gaps],
            "doubled": [list(r) for r in coverage.overlaps],
            "damaged": [d.path for d in coverage.damaged],
            "mismatch": self.mismatch(),
            **({"view_through": self.view_through} if self.upsert else {}),
            **({"chunked": True} if coverage.chunked else {}),
        }

    def mismatch(self) -> str | None:
        problems = self.coverage.problems()
        rows = self.coverage.rows  # one vector each: a chunked record's chunks are rows
        # Upsert mode: tombstones are rows without a vector, so the counts differ.
        if not self.upsert and self.index_entries is not None and self.index_entries != rows:
            problems.append(f"index has {self.index_entries} entries for {rows} rows")
        return "; ".join(problems) or None


def output_facts(
    output: Output, committed: Mapping[Key, int], keys: Sequence[Key]
) -> tuple[dict[Key, PartitionOutput], list[str]]:
    """Per partition of `keys`, what the output holds; plus warnings (damaged files, ...)."""
    warnings: list[str] = []
    if not has_vectors(output):
        warnings.append(f"{describe(output)} has no vectors/ folder: no segments")
    wanted = {k: committed[k] for k in keys if k in committed}
    coverage = output_coverage(output, wanted, {topic for topic, _ in keys})
    entries, problem = index_entries(output)
    if problem:
        warnings.append(problem)
    upsert = has_view(output)
    positions = ViewStore(output).positions() if upsert else {}
    facts = {}
    for key in keys:
        found = coverage.get(key) or check_coverage(key, [], [], committed.get(key))
        through = positions.get(f"{key[0]}:{key[1]}")
        facts[key] = PartitionOutput(found, entries.get(key), through, upsert)
        warnings.extend(
            f"damaged segment {d.path}: {d.reason} (its offsets count as missing)"
            for d in found.damaged
        )
    return facts, warnings


def index_entries(output: Output) -> tuple[dict[Key, int], str | None]:
    """Vectors per partition in the index's metadata; a problem line if unreadable."""
    files = index_files(output)
    try:
        text = files.meta_text()
        if text is None:
            return {}, None
        raw = json.loads(text).get("entries") or {}
        entries = {}
        for name, count in raw.items():
            topic, _, partition = name.rpartition(":")
            entries[(topic, int(partition))] = int(count)
        return entries, None
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        return {}, f"cannot read the index metadata in {files.where}: {exc}"
