"""`pipeline compact --purge`: erasure in upsert mode. Superseded and deleted
documents leave every file of the output: the history segments, the index and
the current view's older versions.

The view says what is erased: a segment row at or below the view's position in its
partition that is not a live row of the view is a superseded version, a deleted
document or a tombstone. Rows past the positions are not judged yet (the next
purge takes them). A row once erasable stays so: a later change only supersedes
more, so workers may go on writing and applying meanwhile.

1. the view catches up with the segments, and its positions and live rows are read
   at one version;
2. a compaction rewrites each segment holding erasable rows without them, its
   footer recording their offsets as purged (sinks.segments: the audit counts them
   as accounted for, not missing), and the swapped-aside files are removed;
3. the index is rebuilt from the purged segments (its shard files held every
   version), keeping only the removals of versions still in them;
4. the view's fragments holding deleted rows are rewritten and its versions older
   than the retention removed (default 0: erasure means now; a reader holding an
   older version open then fails and reads again).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import OutputError
from sinks.compaction import DEFAULT_TARGET_BYTES, CompactionReport, Erasure, compact, settle
from sinks.index.shards import FLAT
from sinks.index.store import IndexStore
from sinks.view import ViewStore, has_view


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
    output: Path,
    target_bytes: int = DEFAULT_TARGET_BYTES,
    retention_s: float = 0.0,
    should_stop: Callable[[], bool] = lambda: False,
) -> PurgeReport:
    """See the module's doc; `should_stop` as for compaction (a stopping worker)."""
    if not isinstance(output, Path):
        raise OutputError("--purge of object-store outputs is not supported yet")
    if not has_view(output):
        raise OutputError(
            f"{output} has no current view: --purge erases superseded and deleted documents "
            "of an upsert-mode output (pipeline run --write-mode upsert)"
        )
    started = time.perf_counter()
    view = ViewStore(output, index=IndexStore(output))
    view.sync()
    through, keep = view.snapshot()
    compacted = compact(output, target_bytes, should_stop=should_stop, erase=Erasure(through, keep))
    settle(output)
    meta = IndexStore(output).saved_meta()
    rebuilt = IndexStore(output, index_type=meta.index_type if meta else FLAT)
    vectors = rebuilt.rebuild()
    rebuilt.prune_removed()  # the erased versions' removals are moot now
    view.maintain(retention_s, erase=True)
    return PurgeReport(
        compacted,
        erased_rows=compacted.erased,
        rewritten_segments=compacted.merged_files,
        live_documents=sum(len(v) for v in keep.values()),
        index_vectors=vectors,
        seconds=time.perf_counter() - started,
    )
