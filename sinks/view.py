"""The current view of an upsert-mode output: `DIR/current`, a Lance table with one
row per live document, its latest version (docs/documents.md).

The view is derived data, like the index: the history segments are the truth, and
`ViewStore.sync()` applies what published segments hold past the view's positions,
in one commit per apply. Each commit records, in its transaction properties, the
last offset applied of every (topic, partition); a sync reads them back from the
table itself, so a worker restarted, rebalanced or killed at any instant neither
applies a change twice nor skips one: a commit either landed with its positions or
did not land.

An apply looks up the live versions of the documents its rows name, lets
sinks.view_plan decide which version of each wins (the highest offset within a
partition; across partitions, the later record timestamp, then the larger topic and
partition), and commits one `merge_insert` on (document, topic, partition, offset):
the live rows replaced or deleted match and go, the new versions match nothing and
come in. Its cost is that of the changes and of the key lookups (a BTREE index on
`doc_key`), not of the table: Lance writes deletion files and new fragments, where a
copy-on-write format rewrites every file a change touches (the measurement:
docs/documents.md).

Lance was chosen over Delta Lake by that measurement; readers: pylance, Polars and
DuckDB through `lance.dataset(...)` (an Arrow dataset), Spark through lance-spark.

A deleted document leaves no row here, so the view keeps, beside it, a table of
what it must not forget of keys (sinks.view_keys): each deleted key's latest
tombstone, which a version from another partition must be newer than to bring the
key back, whatever the order in which partitions are applied. An apply writes it
first; its commit then names the version of that table it wrote, with the
positions, so that a commit that did not land leaves nothing learned behind.

In a chunked output (`pipeline run --chunk-tokens N`) a version of a document is
a row per chunk: the view holds every chunk row of each live version, and merges on
(document, topic, partition, offset, chunk). An apply reads whole records (never a
part of one), an update deletes every live row of the version it replaces and
inserts every row of the new one, whatever their number of chunks, and a delete
removes them all: still one commit. The index stops serving every chunk of a
superseded version.

Appliers take turns (sinks.view_lock): a lock file beside the table on a local
output, a lease on an object store; so do the purge's rewrites (`maintain`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.core.chunks import CHAR_END, CHAR_START, CHUNK, CHUNK_COUNT, TOKENS, TRUNCATED
from pipeline.core.documents import DELETED, DOC_KEY
from pipeline.core.errors import OutputError
from pipeline.core.layout import Output, TopicPartitionKey, segments_by_partition
from sinks.index.store import IndexStore
from sinks.segments import DamagedSegment, read_rows, segments_past
from sinks.view_keys import KEY_INDEX, KeyMemory, by_keys, index_keys, literal
from sinks.view_lock import LEASE_S, LeaseLost, LocalLock, StoreLease, commit
from sinks.view_plan import CHUNKS, ORDER, plan

log = logging.getLogger(__name__)

VIEW_DIR = "current"
LOCK_NAME = ".current.lock"
# Transaction property of each applying commit: {"topic:partition": last offset applied}.
POSITIONS = "pipeline.positions"
CROSS_PARTITION = "pipeline.cross_partition_keys"
CROSS_PARTITION_EXAMPLE = "pipeline.cross_partition_example"
# The version of the view's key table (sinks.view_keys) that the commit's state holds.
KEYS_VERSION = "pipeline.keys_version"
# The view's columns, in order (the segment's, less the deletion flag).
COLUMNS = [
    DOC_KEY, "id", "key", "text", "embedding", "topic", "partition", "offset",
    "timestamp", "metadata",
]  # fmt: skip
# Columns the view keeps after those when the segments have them: a chunked output's
# chunk span, and what the model's length cut (pipeline.core.chunks).
OPTIONAL_COLUMNS = [CHUNK, CHUNK_COUNT, CHAR_START, CHAR_END, TRUNCATED, TOKENS]
# Rows read into one apply, at most: bounds its memory.
MAX_APPLY_ROWS = 200_000
# And at most this many bytes of them: the merge joins them in Lance's memory pool
# (300 MB by default), which a larger source overran.
MAX_APPLY_BYTES = 48 << 20
# Versions of the view kept readable by a worker's upkeep (a purge keeps none by default).
RETENTION_S = 3600.0


@dataclass
class ViewState:
    """What each applying commit records in its transaction properties."""

    positions: dict[str, int]  # "topic:partition" -> last offset applied
    cross_partition: int = 0  # distinct document keys seen in more than one partition
    cross_partition_example: str | None = None  # the first of them
    keys_version: int | None = None  # of the key table (sinks.view_keys); None: none yet

    @classmethod
    def of(cls, properties: dict[str, str]) -> ViewState:
        positions = {k: int(v) for k, v in json.loads(properties[POSITIONS]).items()}
        seen = int(properties.get(CROSS_PARTITION, "0"))
        keys = properties.get(KEYS_VERSION)
        return cls(
            positions,
            seen,
            properties.get(CROSS_PARTITION_EXAMPLE) or None,
            int(keys) if keys else None,
        )

    def properties(self) -> dict[str, str]:
        found = {POSITIONS: json.dumps(self.positions, sort_keys=True)}
        if self.cross_partition:
            found[CROSS_PARTITION] = str(self.cross_partition)
            found[CROSS_PARTITION_EXAMPLE] = self.cross_partition_example or ""
        if self.keys_version is not None:
            found[KEYS_VERSION] = str(self.keys_version)
        return found

    def count_cross_partition(self, keys: Sequence[str]) -> None:
        """Counts keys seen in more than one partition for the first time."""
        self.cross_partition += len(keys)
        if keys and self.cross_partition_example is None:
            self.cross_partition_example = keys[0]


@dataclass
class ViewStats:
    applied_rows: int = 0  # segment rows read past the positions
    upserted: int = 0  # documents given a new version
    deleted: int = 0  # documents deleted
    commits: int = 0
    seconds: float = 0.0


def view_path(output: Path) -> Path:
    return output / VIEW_DIR


def has_view(output: Output) -> bool:
    """Whether `output` (a directory, or an object store) has a current view."""
    if isinstance(output, Path):
        return view_path(output).is_dir()
    return next(iter(output.list(f"{VIEW_DIR}/_versions/", page_size=1)), None) is not None


def _tp(topic: str, partition: int) -> str:
    return f"{topic}:{partition}"


def _key(tp: str) -> TopicPartitionKey:
    topic, _, partition = tp.rpartition(":")
    return topic, int(partition)


class ViewStore:
    """The current view of one output: a local directory, or an object store."""

    def __init__(
        self, output: Output, max_apply_rows: int = MAX_APPLY_ROWS, index: IndexStore | None = None
    ) -> None:
        """`index`: the index that stops serving the versions an apply supersedes."""
        self.output = output
        self.index = index
        self.keys = KeyMemory(output)  # what the view remembers of deleted keys
        if isinstance(output, Path):
            self.uri, self.options = str(view_path(output)), None
            self.lock: LocalLock | StoreLease = LocalLock(output / LOCK_NAME)
        else:
            self.uri = f"{output.url.rstrip('/')}/{VIEW_DIR}"
            self.options = output.connection_options()
            self.lock = StoreLease(output)
        self.max_apply_rows = max_apply_rows
        self.last_sync = ViewStats()
        self.damaged: list[DamagedSegment] = []

    # -- reading ------------------------------------------------------------------

    def dataset(self) -> Any | None:
        """The table at its latest version (pylance's LanceDataset); None before the
        first apply."""
        import lance

        if not has_view(self.output):
            return None
        return lance.dataset(self.uri, storage_options=self.options)

    def positions(self, dataset: Any | None = None) -> dict[str, int]:
        """The last offset applied per "topic:partition", as the latest applying commit
        recorded it."""
        return self.state(dataset).positions

    def state(self, dataset: Any | None = None) -> ViewState:
        """What the latest applying commit recorded (an empty state before the first)."""
        dataset = dataset if dataset is not None else self.dataset()
        if dataset is None:
            return ViewState({})
        for version in range(dataset.version, 0, -1):
            try:
                transaction = dataset.read_transaction(version)
            except TypeError:  # pylance 14 cannot rebuild a compaction's RewrittenIndex
                continue  # in Python: not an applying commit, read past it
            properties = transaction.transaction_properties if transaction else None
            if properties and POSITIONS in properties:
                return ViewState.of(properties)
        raise OutputError(
            f"the view at {self.uri} records no positions; remove it and a worker rebuilds it"
        )

    def live(self, where: Sequence[tuple[str, int, int]], columns: Sequence[str]) -> pa.Table:
        """The live rows at the given (topic, partition, offset)s (those not live: absent)."""
        dataset = self.dataset()
        if dataset is None or not where:
            return pa.table({c: [] for c in columns})
        grouped: dict[tuple[str, int], list[int]] = {}
        for topic, partition, offset in where:
            grouped.setdefault((topic, partition), []).append(offset)
        predicate = " OR ".join(
            f"(topic = {literal(t)} AND partition = {p} AND offset IN ({', '.join(map(str, o))}))"
            for (t, p), o in grouped.items()
        )
        return dataset.to_table(columns=list(columns), filter=predicate)

    def snapshot(self) -> tuple[dict[TopicPartitionKey, int], dict[TopicPartitionKey, np.ndarray]]:
        """At one version: the positions, and the live offsets (sorted, distinct: a
        chunked version's rows share one) per partition."""
        dataset = self.dataset()
        if dataset is None:
            return {}, {}
        positions = {_key(tp): offset for tp, offset in self.positions(dataset).items()}
        table = dataset.to_table(columns=["topic", "partition", "offset"])
        live: dict[TopicPartitionKey, list[np.ndarray]] = {}
        for batch in table.to_batches():
            frame = {c: batch.column(c).to_numpy(zero_copy_only=False) for c in batch.schema.names}
            for topic, partition in set(zip(frame["topic"], frame["partition"], strict=True)):
                mask = (frame["topic"] == topic) & (frame["partition"] == partition)
                live.setdefault((str(topic), int(partition)), []).append(frame["offset"][mask])
        return positions, {k: np.unique(np.concatenate(v)) for k, v in live.items()}

    def maintain(self, retention_s: float = RETENTION_S, erase: bool = False) -> bool:
        """Merges small fragments, rewrites those holding deleted rows, brings the key
        index up to date, and removes the versions older than `retention_s` with their
        files; whether it ran (another worker may hold the view). With `erase` (a
        purge), every fragment holding a deleted row is rewritten, and unreferenced
        files go too: after it, no file of the table holds a row deleted before it."""
        with self.lock.held(wait_s=LEASE_S + 10 if erase else 0.0) as held:
            dataset = self.dataset()
            if dataset is None:
                return False
            if not held:
                if erase:
                    raise OutputError(f"another worker holds the view at {self.uri}; try again")
                return False
            dataset.optimize.compact_files(
                materialize_deletions=True, materialize_deletions_threshold=0.0 if erase else 0.1
            )
            self.dataset().optimize.optimize_indices()
            # The newest version must name the positions and the key table's compacted
            # version: older ones may go below.
            dataset = self.dataset()
            state = self.state(dataset)
            state.keys_version = self.keys.compact(state.keys_version, self.lock)
            properties = state.properties()
            empty = dataset.schema.empty_table()
            builder = dataset.merge_insert(DOC_KEY).when_not_matched_insert_all()
            transaction, _ = builder.execute_uncommitted(empty)
            properties_only = dataclasses.replace(transaction, transaction_properties=properties)
            commit(dataset, properties_only, self.lock)
            self.dataset().cleanup_old_versions(
                older_than=timedelta(seconds=retention_s), delete_unverified=erase
            )
            self.keys.cleanup(retention_s)
        return True

    def close(self) -> None:
        """Gives the lease up (object stores), so that another worker applies at once."""
        self.lock.release()

    # -- keeping in step with the segments ---------------------------------------------

    def sync(self, wait_s: float = 0.0) -> int:
        """Applies every published segment row past the positions; returns how many rows
        were read (0: the view was caught up, or another worker holds it: waited for up
        to `wait_s`)."""
        started = time.perf_counter()
        total = ViewStats()
        with self.lock.held(wait_s) as held:
            while held and self.lock.renew():
                try:
                    stats = self._apply_once()
                except LeaseLost:
                    log.warning("view: the lease ran out during an apply; it is dropped")
                    break
                total.applied_rows += stats.applied_rows
                total.upserted += stats.upserted
                total.deleted += stats.deleted
                total.commits += stats.commits
                if not stats.commits:
                    break
        total.seconds = time.perf_counter() - started
        self.last_sync = total
        return total.applied_rows

    def _apply_once(self) -> ViewStats:
        dataset = self.dataset()
        state = self.state(dataset)
        rows, moved = self._pending(state.positions)
        if not moved:
            return ViewStats()
        keys = rows.column(DOC_KEY).unique().to_pylist() if rows.num_rows else []
        memory = self.keys.settle(state.keys_version, self.lock)
        known = self.keys.lookup(memory, keys)
        change = plan(rows, self._live_versions(dataset, keys), known.tombstones, known.flagged)
        if self.index is not None:  # before the commit: a removal is never wrong early
            # Chunked: every chunk 0..chunk_count-1 of each version (sinks.index.removed).
            self.index.remove(change.removed, change.removed_counts)
        state.positions.update(moved)
        # Phase one: what the apply learned of its keys, in the version the commit names.
        state.keys_version = self.keys.learn(
            memory, known, change.tombstones, change.cross_partition, self.lock
        )
        state.count_cross_partition(change.cross_partition)
        if change.cross_partition:
            log.warning(
                "view: %d document key(s) seen in more than one partition (%r first); the "
                "later record timestamp wins (docs/documents.md: ordering)",
                len(change.cross_partition), change.cross_partition[0],
            )  # fmt: skip
        if dataset is None:
            upserts = change.upserts.select(_view_columns(rows.column_names))
            self._create(upserts, state.properties())
            return ViewStats(rows.num_rows, change.documents, 0, 1)
        upserts = change.upserts.select(dataset.schema.names)
        # One merge on (document, place), and chunk in a chunked view: the live rows
        # replaced or deleted match exactly and go; the new versions match nothing and
        # come in. Both are found by the key index, where a "delete what the source
        # lacks" clause scans the whole table (2.4 s against 0.2 s for 5,000 changes at
        # 1M documents).
        replaced = _rows_like(dataset.schema, change.replaced)
        builder = dataset.merge_insert(_merge_keys(dataset.schema)).when_matched_delete()
        transaction, merged = builder.when_not_matched_insert_all().execute_uncommitted(
            pa.concat_tables([replaced, upserts.cast(dataset.schema)])
        )
        if (merged["num_deleted_rows"], merged["num_inserted_rows"]) != (
            replaced.num_rows, upserts.num_rows,
        ):  # fmt: skip
            raise OutputError(
                f"the view at {self.uri} changed under its applier ({merged}, expected "
                f"{replaced.num_rows} replaced and {upserts.num_rows} new rows): nothing applied"
            )
        transaction = dataclasses.replace(transaction, transaction_properties=state.properties())
        commit(dataset, transaction, self.lock)
        index_keys(self.dataset())  # the rows it inserted, once they are many
        return ViewStats(rows.num_rows, change.documents, len(change.gone), 1)

    def _create(self, upserts: pa.Table, properties: dict[str, str]) -> None:
        import lance

        dataset = lance.write_dataset(
            upserts, self.uri, storage_options=self.options, transaction_properties=properties
        )
        dataset.create_scalar_index(DOC_KEY, "BTREE", name=KEY_INDEX)

    def _live_versions(self, dataset: Any | None, keys: list[str]) -> dict[str, dict[str, Any]]:
        """The live version of each of `keys` the view holds (its ORDER columns; in a
        chunked view also its CHUNK_COUNT, and its rows' chunk numbers as CHUNKS)."""
        if dataset is None or not keys:
            return {}
        chunked = CHUNK in dataset.schema.names
        columns = [DOC_KEY, *ORDER, *([CHUNK, CHUNK_COUNT] if chunked else [])]
        found: dict[str, dict[str, Any]] = {}
        for table in by_keys(dataset, keys, columns):
            for row in table.to_pylist():
                if not chunked:
                    found[row[DOC_KEY]] = row
                    continue
                chunk = row.pop(CHUNK)
                found.setdefault(row[DOC_KEY], {**row, CHUNKS: []})[CHUNKS].append(chunk)
        return found

    def _pending(self, positions: dict[str, int]) -> tuple[pa.Table, dict[str, int]]:
        """Segment rows past the positions (up to max_apply_rows rows and MAX_APPLY_BYTES
        bytes: a part of a larger segment at a time), and the positions they take each
        partition to."""
        self.damaged = []
        tables: list[pa.Table] = []
        moved: dict[str, int] = {}
        count = size = 0
        for (topic, partition), segments in segments_by_partition(self.output).items():
            key = _tp(topic, partition)
            through = positions.get(key, -1)
            for segment in segments_past(segments, through):
                if count >= self.max_apply_rows or size >= MAX_APPLY_BYTES:
                    break
                try:
                    table, info = read_rows(segment, [*COLUMNS, DELETED], OPTIONAL_COLUMNS)
                except DamagedSegment as damaged:
                    self.damaged.append(damaged)
                    break  # this partition waits until a worker repairs it
                except FileNotFoundError:
                    break  # merged or moved aside meanwhile: read again next time
                fresh = table.filter(pc.greater(table.column("offset"), through))
                fresh = fresh.select([*COLUMNS, DELETED, *_optional(fresh.column_names)])
                room = _rows_within(fresh, MAX_APPLY_BYTES - size)
                # A large (compacted) segment: a part at a time, of whole records.
                room = _record_end(fresh.column("offset").to_numpy(), room)
                part = room < fresh.num_rows
                if part:
                    fresh = fresh.slice(0, room)
                    through = fresh.column("offset")[-1].as_py()
                else:
                    through = max(through, info.last)
                tables.append(fresh)
                count += fresh.num_rows
                size += fresh.nbytes
                moved[key] = through
                if part:
                    break
        if not tables:
            return pa.table({}), moved
        return pa.concat_tables(tables, promote_options="permissive"), moved


def _view_columns(names: Sequence[str]) -> list[str]:
    """The columns of a view created from rows with these columns."""
    return [*COLUMNS, *_optional(names)]


def _optional(names: Sequence[str]) -> list[str]:
    return [c for c in OPTIONAL_COLUMNS if c in names]


def _merge_keys(schema: pa.Schema) -> list[str]:
    """What identifies a row of the view: its document and version, and its chunk in a
    chunked view (a version's rows differ by chunk only). A version is its (topic,
    partition, offset): each partition counts offsets from 0, so a document's versions
    in two partitions often share an offset (a merge on the offset alone matched one
    live row with two source rows, which Lance refuses)."""
    return [DOC_KEY, "topic", "partition", "offset", *([CHUNK] if CHUNK in schema.names else [])]


def _record_end(offsets: np.ndarray, room: int) -> int:
    """How many of the first rows (sorted by offset) to take: at most `room` where that
    ends a record (a record's rows, its chunks, share an offset), else up to the start
    of the record it would cut, and the first record whole at least."""
    if room >= len(offsets):
        return len(offsets)
    cut = int(np.searchsorted(offsets, offsets[max(room, 1)], "left"))
    return cut if cut > 0 else int(np.searchsorted(offsets, offsets[0], "right"))


def _rows_like(schema: pa.Schema, rows: list[Any]) -> pa.Table:
    """Rows of `schema` naming the given live rows (their DOC_KEY, ORDER and, in a
    chunked view, CHUNK columns): the merge matches them to the rows to delete; the
    rest is filler."""
    columns = {}
    for field in schema:
        if field.name in (DOC_KEY, *ORDER, CHUNK):
            columns[field.name] = pa.array([r[field.name] for r in rows], field.type)
        elif field.name == "embedding":
            zeros = pa.array(np.zeros(len(rows) * field.type.list_size, np.float32))
            columns[field.name] = pa.FixedSizeListArray.from_arrays(zeros, field.type.list_size)
        elif field.name == "text":
            columns[field.name] = pa.array([""] * len(rows), field.type)
        elif not field.nullable:  # a chunk's span, its token count: zeros
            columns[field.name] = _zeros(field.type, len(rows))
        else:
            columns[field.name] = pa.nulls(len(rows), field.type)
    return pa.table(columns, schema=schema)


def _zeros(kind: pa.DataType, count: int) -> pa.Array:
    if pa.types.is_boolean(kind):
        return pa.array([False] * count, kind)
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return pa.array(np.zeros(count, np.int64)).cast(kind)
    if pa.types.is_string(kind):
        return pa.array([""] * count, kind)
    return pa.nulls(count, kind)


def _rows_within(table: pa.Table, budget: int) -> int:
    """How many of the table's first rows fit in `budget` bytes (one at least)."""
    if table.nbytes <= budget or not table.num_rows:
        return table.num_rows
    return max(1, int(table.num_rows * max(budget, 0) / table.nbytes))
