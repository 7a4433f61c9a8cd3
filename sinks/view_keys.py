"""What the current view (sinks.view) remembers of document keys beside its live
rows: `DIR/current-keys` (and `s3://bucket/prefix/current-keys`), a Lance table of
its own with one row per key that was ever deleted or seen in more than one
partition:

    doc_key                                 the document
    topic, partition, offset, timestamp     its latest tombstone (null: none applied)
    cross_partition                         seen in more than one partition

A tombstone that deleted a key leaves no row in the view; without this table, a
version of the key from another partition, older by the ordering rule
(sinks.view_plan.newer) but applied later, would come back. The table grows only
(as far as the view's commits confirm it: see below), and holds no text or vector:
after an erasure (sinks.purge) a deleted document is a key and a position here, as
its offsets are in the history's accounting.

Two phases, as the view commits its progress: an apply first writes what it learned
of its keys here (phase one), then commits the view with, beside its positions, the
version of this table that holds it (`pipeline.keys_version`, phase two). Whatever
is past the version the view's latest commit names was written by an apply whose
commit did not land: before reading or writing, the applier restores the named
version (`settle`), so that the redone apply sees the keys as its first attempt
did, and no key is counted twice.

The table is found by a BTREE index on `doc_key`, as the view is: a lookup or a
merge costs the keys it names, not the table.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.core.documents import DOC_KEY
from pipeline.core.layout import Output
from sinks.view_lock import LeaseLost, LocalLock, StoreLease, commit
from sinks.view_plan import ORDER

log = logging.getLogger(__name__)

KEYS_DIR = "current-keys"
CROSS_PARTITION = "cross_partition"
SCHEMA = pa.schema(
    [
        pa.field(DOC_KEY, pa.string(), nullable=False),
        pa.field("topic", pa.string()),
        pa.field("partition", pa.int32()),
        pa.field("offset", pa.int64()),
        pa.field("timestamp", pa.int64()),
        pa.field(CROSS_PARTITION, pa.bool_(), nullable=False),
    ]
)
KEY_INDEX = f"{DOC_KEY}_idx"  # a BTREE over the document keys: merges find rows by it
# Rows the doc_key index may leave uncovered before an apply brings it up to date.
UNINDEXED_ROWS = 20_000
LOOKUP_KEYS = 4096  # keys per lookup (one IN list each)

Lock = LocalLock | StoreLease


@dataclass
class Known:
    """What the table holds of some keys."""

    tombstones: dict[str, dict[str, Any]] = field(default_factory=dict)  # ORDER columns
    flagged: set[str] = field(default_factory=set)  # seen in more than one partition


class KeyMemory:
    """The table of one view; every method runs under the view's lock or lease."""

    def __init__(self, output: Output) -> None:
        self.output = output
        if isinstance(output, Path):
            self.uri, self.options = str(output / KEYS_DIR), None
        else:
            self.uri = f"{output.url.rstrip('/')}/{KEYS_DIR}"
            self.options = output.connection_options()
        self._exists = False  # once made, the table stays

    def dataset(self, version: int | None = None) -> Any | None:
        """The table at `version` (None: its latest); None before its first write."""
        import lance

        if not self._exists:
            self._exists = _has_versions(self.output)
            if not self._exists:
                return None
        return lance.dataset(self.uri, version=version, storage_options=self.options)

    def settle(self, version: int | None, lock: Lock) -> Any | None:
        """The table as the view's latest commit names it (`version`), restored where an
        apply wrote past it and its commit did not land. A view that names none (made
        before this table, or rebuilt beside it) keeps the tombstones, which are facts
        of the history, and counts its keys in two partitions again."""
        dataset = self.dataset()
        if dataset is None or dataset.version == version:
            return dataset
        if not lock.valid():
            raise LeaseLost
        if version is None:
            if dataset.count_rows(filter=CROSS_PARTITION) > 0:
                dataset.update({CROSS_PARTITION: "false"}, where=CROSS_PARTITION)
            return self.dataset()
        try:
            self.dataset(version).restore()
        except (FileNotFoundError, ValueError, OSError) as exc:
            # Removed by a clean-up: what is past it is facts all the same, kept.
            log.warning("view: %s version %d cannot be restored (%s)", self.uri, version, exc)
        return self.dataset()

    def lookup(self, dataset: Any | None, keys: Sequence[str]) -> Known:
        """What `dataset` (the table, settled) holds of `keys`."""
        known = Known()
        if dataset is None:
            return known
        for table in by_keys(dataset, keys, [DOC_KEY, *ORDER, CROSS_PARTITION]):
            for row in table.to_pylist():
                if row["offset"] is not None:
                    known.tombstones[row[DOC_KEY]] = {c: row[c] for c in ORDER}
                if row[CROSS_PARTITION]:
                    known.flagged.add(row[DOC_KEY])
        return known

    def learn(
        self,
        dataset: Any | None,
        known: Known,
        tombstones: Mapping[str, Mapping[str, Any]],
        flagged: Sequence[str],
        lock: Lock,
    ) -> int | None:
        """Phase one: writes the keys' new latest tombstones and those newly seen in two
        partitions onto `dataset` (settled; `known`: what it holds of them). Returns the
        table's version that holds them, for the view's commit to name."""
        keys = sorted({*tombstones, *flagged})
        if not keys:
            return None if dataset is None else dataset.version
        rows = [
            {
                DOC_KEY: key,
                **(tombstones.get(key) or known.tombstones.get(key) or dict.fromkeys(ORDER)),
                CROSS_PARTITION: key in known.flagged or key in flagged,
            }
            for key in keys
        ]
        table = pa.Table.from_pylist(rows, schema=SCHEMA)
        if dataset is None:
            return self._create(table, lock)
        # Every row whole (what `known` held, and what is new): an update replaces them.
        builder = dataset.merge_insert(DOC_KEY).when_matched_update_all()
        transaction, _ = builder.when_not_matched_insert_all().execute_uncommitted(table)
        commit(dataset, transaction, lock)
        index_keys(self.dataset())
        return self.dataset().version

    def compact(self, version: int | None, lock: Lock) -> int | None:
        """Merges the small fragments applies wrote and brings the key index up to date;
        the version that holds the result (None: no table yet)."""
        dataset = self.settle(version, lock)
        if dataset is None:
            return None
        dataset.optimize.compact_files()
        self.dataset().optimize.optimize_indices()
        return self.dataset().version

    def cleanup(self, retention_s: float) -> None:
        """Removes the versions older than `retention_s` (the latest always stays)."""
        dataset = self.dataset()
        if dataset is not None:
            dataset.cleanup_old_versions(older_than=timedelta(seconds=retention_s))

    def _create(self, table: pa.Table, lock: Lock) -> int:
        import lance

        if not lock.valid():
            raise LeaseLost
        dataset = lance.write_dataset(table, self.uri, storage_options=self.options)
        dataset.create_scalar_index(DOC_KEY, "BTREE", name=KEY_INDEX)
        return self.dataset().version


def by_keys(dataset: Any, keys: Sequence[str], columns: Sequence[str]) -> Iterator[pa.Table]:
    """The rows of `dataset` whose doc_key is one of `keys`, a lookup of at most
    LOOKUP_KEYS keys at a time (each an IN list the key index answers)."""
    for start in range(0, len(keys), LOOKUP_KEYS):
        some = ", ".join(map(literal, keys[start : start + LOOKUP_KEYS]))
        yield dataset.to_table(columns=list(columns), filter=f"{DOC_KEY} IN ({some})")


def index_keys(dataset: Any) -> None:
    """Gives `dataset` its doc_key index where it has none (a worker killed between
    creating a table and its index), and adds the rows it does not cover once they
    are many: a merge reads the rows the index does not cover, which would grow with
    the table (a 5,000-row merge: 2.7 s over 970k unindexed rows of 1M, 0.2 s
    indexed)."""
    if KEY_INDEX not in {i.name for i in dataset.describe_indices()}:
        dataset.create_scalar_index(DOC_KEY, "BTREE", name=KEY_INDEX)
        return
    stats = dataset.stats.index_stats(KEY_INDEX)
    if stats.get("num_unindexed_rows", 0) >= UNINDEXED_ROWS:
        dataset.optimize.optimize_indices()


def literal(text: str) -> str:
    """`text` as an SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def _has_versions(output: Output) -> bool:
    """Whether the table has been made under `output` (a committed version)."""
    if isinstance(output, Path):
        return (output / KEYS_DIR / "_versions").is_dir()
    return next(iter(output.list(f"{KEYS_DIR}/_versions/", page_size=1)), None) is not None
