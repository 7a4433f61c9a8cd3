"""`pipeline audit`: does the output hold every committed offset exactly once?

Per partition of the audited topics, every offset below the group's committed
offset must be in exactly one Parquet row or in the dead-letter topic (matched
by the `source.*` headers of its dead letters). The audit does not take the
worker's word for it: segment ranges and `segment.records` are what the worker
claims, so they are never used to excuse an offset. Instead

    accounted = rows ∪ dead letters
    gaps      = [checked_from, committed) − accounted

and the gaps are read from Kafka itself with a read_committed consumer: a real
record found in a gap is MISSING; an offset with no record (a transaction
marker, an aborted transactional record, a compacted-away record) is fine.
Only the gaps are read (merged into few windows, one seek each), so the audit
of a large topic reads little more than what is wrong with it.

Offsets below the partition's log-start offset cannot be read any more: gaps
there are counted as `unverifiable`, not missing. When the partition's first
segment says `segment.start = from-committed`, the user started this output at
the group's committed offset, and offsets below that segment are not its
responsibility (`checked_from`).

DOUBLED: an offset in two rows (in one file or across files), or in a row and
in the dead-letter topic. The same offset dead-lettered twice is a dead-letter
*repeat*, listed on its own and failing the audit too: each bad record is in the
dead-letter topic exactly once (consumers.dead_letters).

CHUNKS: in a chunked output (`pipeline run --chunk-tokens N`) a record is a row
per chunk, all in one segment: the accounting above counts its offset once per
segment holding rows of it (twice: doubled), and every record's rows must be
(offset, chunk) for chunk 0..chunk_count-1 exactly once each, with one
chunk_count; a record otherwise (a chunk missing, twice, past the count, counts
that disagree) is listed as `bad_chunks` and fails the audit. `rows` counts
records there, `chunk_rows` the rows.

This package also holds the segment coverage check that `pipeline status
--output` uses (`output_coverage`): from the footers alone, do the segments of
a partition tile its offsets from the first segment up to the committed offset,
with no gap and no overlap? One implementation for both commands.

One module per concern:

    ranges       offset ranges: runs, merge, complement, clip, count, within (pure)
    coverage     segment coverage from the footers (also `pipeline status --output`)
    rows         the output's rows: every record's offset per partition
    chunks       a chunked output's records: are their chunks complete? (pure)
    accounting   audit_partition: one partition's offsets accounted for (pure)
    kafka_reads  what is read from Kafka: dead letters and the gaps
    run          run_audit: the audit of one group's output
    report       audit_report and render_audit: the report and its human form
"""

from pipeline.audit.accounting import PartitionAudit, Scan, audit_partition
from pipeline.audit.chunks import ChunkProblem, bad_chunk_offsets, chunk_problems
from pipeline.audit.coverage import (
    Coverage,
    DamagedFile,
    check_coverage,
    output_coverage,
    read_footers,
)
from pipeline.audit.kafka_reads import (
    MERGE_WITHIN,
    STALL_S,
    DeadLetters,
    kafka_scan,
    read_dead_letters,
)
from pipeline.audit.ranges import (
    Key,
    Range,
    clip,
    complement,
    count,
    describe_ranges,
    merge,
    runs,
    within,
)
from pipeline.audit.report import audit_report, render_audit
from pipeline.audit.rows import OutputRows, read_output_rows
from pipeline.audit.run import present_topics, resolve_topics, run_audit

__all__ = [
    "MERGE_WITHIN",
    "STALL_S",
    "ChunkProblem",
    "Coverage",
    "DamagedFile",
    "DeadLetters",
    "Key",
    "OutputRows",
    "PartitionAudit",
    "Range",
    "Scan",
    "audit_partition",
    "audit_report",
    "bad_chunk_offsets",
    "check_coverage",
    "chunk_problems",
    "clip",
    "complement",
    "count",
    "describe_ranges",
    "kafka_scan",
    "merge",
    "output_coverage",
    "present_topics",
    "read_dead_letters",
    "read_footers",
    "read_output_rows",
    "render_audit",
    "resolve_topics",
    "run_audit",
    "runs",
    "within",
]
