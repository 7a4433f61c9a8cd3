"""`pipeline compact --purge`: erasure in upsert mode. Superseded and deleted
documents leave every file of the output: the history segments, the index and
the current view's older versions.

The view says what is erased: a segment row at or below the view's position in its
partition that is not a live row of the view is a superseded version, a deleted
document or a tombstone. Rows past the positions are not judged yet (the next
purge takes them). A row once erasable stays so: a later change only supersedes
more, so workers may go on writing and applying meanwhile. In a chunked output a
version is every row of its offset (one per chunk), judged by that offset: all of
them stay, or all go, and the footer names the offset purged once.

1. the view catches up with the segments, and its positions and live rows are read
   at one version;
2. a compaction rewrites each segment holding erasable rows without them, its
   footer recording their offsets as purged (sinks.segments: the audit counts them
   as accounted for, not missing), and the swapped-aside files are removed; on an
   object store each such segment is written again under its own name;
3. the index is rebuilt from the purged segments (its shard files held every
   version), keeping only the removals of versions still in them, and the earlier
   generations' files are removed at once (on an object store they are otherwise
   kept a while for readers);
4. the view's fragments holding deleted rows are rewritten and its versions older
   than the retention removed (default 0: erasure means now; a reader holding an
   older version open then fails and reads again).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from pipeline.core.errors import OutputError
from pipeline.core.layout import Output, describe, segments_by_partition, vectors_key
from sinks.compaction import DEFAULT_TARGET_BYTES, CompactionReport, Erasure, compact, settle
from sinks.index.shards import FLAT
from sinks.index.store import IndexStore
from sinks.parquet import encode
from sinks.segments import PURGED_KEY, DamagedSegment, info_from_metadata, read_table
from sinks.view import ViewStore, has_view

if TYPE_CHECKING:
    from sinks.objectstore import ObjectStore


@dataclass
class PurgeReport:
    compaction: CompactionReport
    erased_rows: int = 0
    rewritten_segments: int = 0
    live_documents: int = 0
    index_vectors: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        found = asdict(self)
        del found["compaction"]
        return found


def purge(
    output: Output,
    target_bytes: int = DEFAULT_TARGET_BYTES,
    retention_s: float = 0.0,
    should_stop: Callable[[], bool] = lambda: False,
) -> PurgeReport:
    """See the module's doc; `should_stop` as for compaction (a stopping worker)."""
    if not has_view(output):
        raise OutputError(
            f"{describe(output)} has no current view: --purge erases superseded and deleted "
            "documents of an upsert-mode output (pipeline run --write-mode upsert)"
        )
    started = time.perf_counter()
    view = ViewStore(output, index=IndexStore(output))
    view.sync()
    through, keep = view.snapshot()
    erase = Erasure(through, keep)
    if isinstance(output, Path):
        compacted = compact(output, target_bytes, should_stop=should_stop, erase=erase)
        settle(output)
    else:
        compacted = _purge_objects(output, erase)
    meta = IndexStore(output).saved_meta()
    rebuilt = IndexStore(output, index_type=meta.index_type if meta else FLAT)
    vectors = rebuilt.rebuild()
    rebuilt.prune_removed()  # the erased versions' removals are moot now
    rebuilt.remove_history()  # earlier generations' shards hold the erased vectors
    view.maintain(retention_s, erase=True)
    return PurgeReport(
        compacted,
        erased_rows=compacted.erased,
        rewritten_segments=compacted.merged_files,
        live_documents=sum(len(v) for v in keep.values()),
        index_vectors=vectors,
        seconds=time.perf_counter() - started,
    )


def _purge_objects(store: ObjectStore, erase: Erasure) -> CompactionReport:
    """On an object store, which has no compaction: each segment holding erased rows is
    written again under its own name without them (a PUT replaces an object whole, so
    a reader gets the old segment or the new one, of the same range), its footer
    naming the erased offsets purged."""
    report = CompactionReport()
    for key, segments in segments_by_partition(store).items():
        report.files_before += len(segments)
        for segment in segments:
            try:
                table = read_table(segment)
                info = info_from_metadata(segment, table.schema.metadata, table.num_rows)
            except (FileNotFoundError, DamagedSegment, OSError, pa.ArrowException):
                continue  # gone, or damaged: a worker repairs it from Kafka
            offsets = table.column("offset").to_numpy().astype(np.int64)
            mask = erase.mask(key, offsets)
            if not mask.any():
                continue
            metadata = dict(table.schema.metadata or {})
            purged = Erasure.purged(info.purged, [offsets[mask]])
            metadata[PURGED_KEY.encode()] = json.dumps([list(r) for r in purged]).encode()
            kept = table.filter(pa.array(~mask)).replace_schema_metadata(metadata)
            store.put(vectors_key(segment.name), encode(kept))
            report.erased += int(mask.sum())
            report.merged_files += 1
            report.rows += kept.num_rows
    report.files_after = report.files_before
    return report
