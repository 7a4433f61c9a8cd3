"""Parquet sink: one segment per (partition, offset range) of a micro-batch,
written durably and published atomically, at most once per name.

Publishing is two-phase so the committer can slot the dead-letter flush in
between: `stage()` writes `<hidden name>.tmp` and fsyncs it; `publish()` links
it to its final `.parquet` name only if that name does not exist yet (a
create-if-absent, never a rename over), then fsyncs the directory. A segment's
name is its first offset (see `pipeline.core.layout`), so when two writers believe they
own a partition, exactly one of them publishes the range starting there and the
other learns it lost. A published file is never rewritten.

On an object store (see pipeline.core.layout) there is no link and no temp file:
`stage()` encodes the segment in memory and `publish()` uploads it with a
create-if-absent PUT (`If-None-Match: *`) under the same final name, which the
store makes durable before it answers. The race between two owners is the
same race, decided by the store.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.chunks import (
    CHUNK,
    CHUNK_COUNT,
    CHUNKED,
    FLAGGED,
    PLAIN,
    SPAN_COLUMNS,
    TOKENS,
    TRUNCATED,
    Chunking,
    Span,
)
from pipeline.core.documents import DELETED, DOC_KEY, Deletion, DocumentKeys
from pipeline.core.errors import OutputError
from pipeline.core.host import fsync_dir
from pipeline.core.layout import (
    TMP_SUFFIX,
    VECTORS_DIR,
    Output,
    SegmentKey,
    vectors_dir,
    vectors_key,
)
from pipeline.core.model_info import ModelInfo
from pipeline.core.records import GoodRecord
from sinks.segments import DeadLetterMark, segment_metadata
from sinks.vectors_swap import VectorsLock, fenced
from sinks.writers import WRITER, hold_writer_lock, remove_stale_temp_files

log = logging.getLogger(__name__)

# Codec chosen by measurement (docs/performance.md): zstd, with BYTE_STREAM_SPLIT on
# the embedding floats, is the smallest and the fastest write. Float vectors barely
# compress; splitting the float bytes into streams is what lets zstd find the
# redundancy in exponents.
CODEC = "zstd"
EMBEDDING_LEAF = "embedding.list.element"

if TYPE_CHECKING:
    from sinks.objectstore import ObjectStore

_stage_numbers = itertools.count()


def schema(dim: int, upsert: bool = False, rows: str = FLAGGED) -> pa.Schema:
    """A segment's columns; upsert mode adds the document key and the deletion flag
    (pipeline.core.documents); then what rows say of their text (pipeline.core.chunks):
    nothing in outputs made before (PLAIN), whether it was truncated and the tokens
    embedded (FLAGGED), and the chunk's place in its record's text first (CHUNKED)."""
    documents = [
        pa.field(DOC_KEY, pa.string(), nullable=False),
        pa.field(DELETED, pa.bool_(), nullable=False),
    ]
    spans = [pa.field(name, pa.int32(), nullable=False) for name in SPAN_COLUMNS]
    flags = [
        pa.field(TRUNCATED, pa.bool_(), nullable=False),
        pa.field(TOKENS, pa.int32(), nullable=False),
    ]
    return pa.schema(
        [
            pa.field("topic", pa.string(), nullable=False),
            pa.field("partition", pa.int32(), nullable=False),
            pa.field("offset", pa.int64(), nullable=False),
            pa.field("key", pa.binary()),
            pa.field("id", pa.string()),
            pa.field("text", pa.string(), nullable=False),
            pa.field("timestamp", pa.int64(), nullable=False),
            pa.field("metadata", pa.string()),
            pa.field("embedding", pa.list_(pa.field("item", pa.float32()), dim), nullable=False),
            *(documents if upsert else []),
            *(spans if rows == CHUNKED else []),
            *(flags if rows != PLAIN else []),
        ]
    )


def placeholder_row(columns: pa.Schema) -> pa.Table:
    """One row of these columns: zeros, empty strings and False where a value is
    required, nulls elsewhere (the preload's; every mode's columns fit it)."""

    def value(field: pa.Field) -> object:
        if pa.types.is_fixed_size_list(field.type):
            return [0.0] * field.type.list_size
        if field.nullable:
            return None
        if pa.types.is_string(field.type):
            return ""
        return False if pa.types.is_boolean(field.type) else 0

    return pa.Table.from_pydict({f.name: [value(f)] for f in columns}, schema=columns)


@dataclass(frozen=True)
class StagedFile:
    key: SegmentKey
    last: int
    tmp_path: Path | None  # local outputs: the fsynced temp file
    final_path: Path | None  # local outputs
    rows: int
    data: bytes | None = None  # object-store outputs: the encoded segment


class ParquetSink:
    def __init__(
        self,
        output: Output,
        model: ModelInfo,
        documents: DocumentKeys | None = None,
        rows: str = FLAGGED,
        chunking: Chunking | None = None,
    ) -> None:
        """`documents`: how records name their documents, in upsert mode (None: append).
        `rows`: the row columns this output holds (sinks.identity.check_output_rows);
        `chunking`: how records are cut into chunks, recorded in the footers."""
        self.output = output
        self.store: ObjectStore | None = None if isinstance(output, Path) else output
        self.directory = vectors_dir(output) if isinstance(output, Path) else Path(VECTORS_DIR)
        # Held shared while a file is created, written or published here, so
        # that a compaction's directory exchange never leaves one behind.
        self.lock = VectorsLock(output) if isinstance(output, Path) else None
        self._model_metadata = {f"embedding.{k}": v for k, v in model.as_metadata().items()}
        if chunking is not None:
            self._model_metadata.update(chunking.as_metadata())
        self._schema = schema(model.dim, upsert=documents is not None, rows=rows)
        self.rows = rows
        self._dim = model.dim
        self.documents = documents

    def preload(self) -> None:
        """Writes a one-row segment to a temporary folder and reads it back as the
        index sync does, at start-up: pyarrow loads its Parquet writer, dataset and
        compute code on first use, and left to the first index sync, half a minute
        into a nearline run, that added library pages to a worker whose memory is
        watched for growth. Best effort: a failure here is only logged."""
        try:
            with tempfile.TemporaryDirectory(prefix="pipeline-preload-") as folder:
                path = Path(folder) / "preload.parquet"
                _write(placeholder_row(self._schema), str(path))
                pq.read_table(path, columns=["offset", "embedding"])
        except (OSError, pa.ArrowException) as exc:
            log.debug("parquet: preload skipped: %s", exc)

    def exists(self, key: SegmentKey) -> bool:
        """Whether a segment starting at `key.first` is published."""
        if self.store is not None:
            return self.store.exists(vectors_key(key.filename))
        return (self.directory / key.filename).exists()

    def prepare(self) -> int:
        """Creates the directory, checks it is writable, registers this writer (see
        sinks.writers) and removes dead writers' temp files. On an object store:
        checks the bucket answers and refuses a second create of one key."""
        if self.store is not None:
            self.store.check()
            self.store.verify_conditional_put()
            return 0
        assert self.lock is not None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with self.lock.shared():
                probe = self.directory / f".probe.{WRITER}{TMP_SUFFIX}"
                probe.write_bytes(b"")
                probe.unlink()
                hold_writer_lock(self.directory)
        except OSError as exc:
            raise OutputError(f"output directory {self.directory} is not writable: {exc}") from exc
        with self.lock.shared():
            return remove_stale_temp_files(self.directory)

    def stage(
        self,
        key: SegmentKey,
        last: int,
        records: Sequence[GoodRecord],
        vectors: np.ndarray,
        consumed: int,
        start: str | None = None,
        dead_letters: DeadLetterMark | None = None,
        deletions: Sequence[Deletion] = (),
        tokens: Sequence[int] | None = None,
    ) -> StagedFile:
        """Writes offsets key.first..last (`consumed` records, the good ones and, in upsert
        mode, the deletions given) aside. `records` are rows (a chunked record's chunks,
        together), `tokens` the tokens each row's vector was embedded from."""
        metadata = segment_metadata(key.first, last, consumed, WRITER, start, dead_letters)
        table = self._table(records, vectors, {**self._model_metadata, **metadata})
        if self.documents is not None:
            table = self._with_documents(table, records)
        table = self._with_rows(table, records, tokens)
        if deletions:
            table = self._with_deletions(table, deletions)
        table = table.cast(self._schema.with_metadata(table.schema.metadata))
        if self.store is not None:
            buffer = pa.BufferOutputStream()
            _write(table, buffer)
            return StagedFile(key, last, None, None, table.num_rows, buffer.getvalue().to_pybytes())
        assert self.lock is not None
        final = self.directory / key.filename
        # Unique per call: a staged file is never overwritten by another stage.
        tmp = self.directory / f".{key.filename}.{next(_stage_numbers)}.{WRITER}{TMP_SUFFIX}"
        try:
            with self.lock.shared(), open(tmp, "wb") as fh:
                _write(table, fh)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise output_error(exc, tmp) from exc
        return StagedFile(key, last, tmp, final, table.num_rows)

    def publish(self, staged: StagedFile) -> bool:
        """Publishes the staged file under its final name unless that name exists.

        False when another writer published a segment starting at the same
        offset first, or a compaction merged a range holding that offset (see
        sinks.vectors_swap), or a writer cleaned this temp file away: the caller
        must then treat the partition's position as unknown and read it from
        the directory.
        """
        if self.store is not None:
            assert staged.data is not None
            return self.store.put_if_absent(vectors_key(staged.key.filename), staged.data)
        assert self.lock is not None and staged.tmp_path is not None
        with self.lock.shared():
            if fenced(self.directory, staged.key):
                staged.tmp_path.unlink(missing_ok=True)
                return False
            return self._link(staged)

    def _link(self, staged: StagedFile) -> bool:
        assert staged.tmp_path is not None and staged.final_path is not None
        try:
            os.link(staged.tmp_path, staged.final_path)
        except FileExistsError:
            staged.tmp_path.unlink(missing_ok=True)
            return False
        except FileNotFoundError:
            return False  # removed as stale while this writer was stopped
        except OSError as exc:
            staged.tmp_path.unlink(missing_ok=True)
            if exc.errno in (errno.EPERM, errno.ENOTSUP, errno.EXDEV):
                raise OutputError(
                    f"the filesystem of {self.directory} does not support hard links, which "
                    "publishing needs (create-if-absent); use a local or NFS directory"
                ) from exc
            raise output_error(exc, staged.final_path) from exc
        try:
            staged.tmp_path.unlink()
            fsync_dir(self.directory)
        except OSError as exc:
            raise output_error(exc, staged.final_path) from exc
        return True

    def discard(self, staged: StagedFile) -> None:
        if self.lock is None or staged.tmp_path is None:
            return  # nothing was written anywhere
        with self.lock.shared():
            staged.tmp_path.unlink(missing_ok=True)

    def _table(
        self, records: Sequence[GoodRecord], vectors: np.ndarray, metadata: dict[str, str]
    ) -> pa.Table:
        flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).ravel(), pa.float32())
        # Columns by C-level maps over the records (tuples): less of the write
        # stage's GIL a row than a list comprehension a column.
        unzipped = zip(*records, strict=True) if records else [()] * 5
        sources, texts, record_ids, metadatas, _ = unzipped

        def field(name: str) -> list[Any]:
            return list(map(attrgetter(name), sources))

        columns = [
            pa.array(field("topic"), pa.string()),
            pa.array(field("partition"), pa.int32()),
            pa.array(field("offset"), pa.int64()),
            pa.array(field("key"), pa.binary()),
            pa.array(record_ids, pa.string()),
            pa.array(texts, pa.string()),
            pa.array(field("timestamp"), pa.int64()),
            pa.array(metadatas, pa.string()),
            pa.FixedSizeListArray.from_arrays(flat, self._dim),
        ]
        plain = schema(self._dim, rows=PLAIN)
        return pa.Table.from_arrays(columns, schema=plain.with_metadata(metadata))

    def _with_documents(self, table: pa.Table, records: Sequence[GoodRecord]) -> pa.Table:
        """The rows with their document keys (pipeline.core.documents)."""
        assert self.documents is not None
        keys = [self.documents.key_of(r) for r in records]
        table = table.append_column(DOC_KEY, pa.array(keys, pa.string()))
        return table.append_column(DELETED, pa.array([False] * len(records), pa.bool_()))

    def _with_rows(
        self, table: pa.Table, records: Sequence[GoodRecord], tokens: Sequence[int] | None
    ) -> pa.Table:
        """The rows with what they say of their text (pipeline.core.chunks): a row without
        a span is its record's whole text, not truncated."""
        if self.rows == PLAIN:
            return table
        spans = [r.span or Span(0, 1, 0, len(r.text)) for r in records]
        if self.rows == CHUNKED:
            for n, name in enumerate(SPAN_COLUMNS):
                table = table.append_column(name, pa.array([s[n] for s in spans], pa.int32()))
        truncated = [s.truncated for s in spans]
        table = table.append_column(TRUNCATED, pa.array(truncated, pa.bool_()))
        counts = list(tokens) if tokens is not None else [0] * len(records)
        return table.append_column(TOKENS, pa.array(counts, pa.int32()))

    def _with_deletions(self, table: pa.Table, deletions: Sequence[Deletion]) -> pa.Table:
        """The rows and a row per deletion (no text, a zero vector, the whole of nothing),
        in offset order (a record's chunks in theirs)."""
        zeros = pa.array(np.zeros(len(deletions) * self._dim, np.float32), pa.float32())
        sources = [d.source for d in deletions]
        columns = {
            "topic": pa.array([s.topic for s in sources], pa.string()),
            "partition": pa.array([s.partition for s in sources], pa.int32()),
            "offset": pa.array([s.offset for s in sources], pa.int64()),
            "key": pa.array([s.key for s in sources], pa.binary()),
            "id": pa.nulls(len(sources), pa.string()),
            "text": pa.array([""] * len(sources), pa.string()),
            "timestamp": pa.array([s.timestamp for s in sources], pa.int64()),
            "metadata": pa.nulls(len(sources), pa.string()),
            "embedding": pa.FixedSizeListArray.from_arrays(zeros, self._dim),
            DOC_KEY: pa.array([d.key for d in deletions], pa.string()),
            DELETED: pa.array([True] * len(deletions), pa.bool_()),
            CHUNK_COUNT: pa.array([1] * len(deletions), pa.int32()),
            TRUNCATED: pa.array([False] * len(deletions), pa.bool_()),
        }
        zero = pa.array([0] * len(deletions), pa.int32())
        arrays = [columns.get(name, zero) for name in table.schema.names]
        gone = pa.Table.from_arrays(arrays, schema=table.schema)
        order = [("offset", "ascending")] + ([(CHUNK, "ascending")] if self.rows == CHUNKED else [])
        return pa.concat_tables([table, gone]).sort_by(order)


def encode(table: pa.Table) -> bytes:
    """A segment's bytes, written as the sink writes segments."""
    buffer = pa.BufferOutputStream()
    _write(table, buffer)
    return buffer.getvalue().to_pybytes()


def _write(table: pa.Table, sink: Any) -> None:
    pq.write_table(
        table,
        sink,
        compression=CODEC,
        use_dictionary=["topic"],
        use_byte_stream_split=[EMBEDDING_LEAF],
    )


def output_error(exc: OSError, path: Path) -> OutputError:
    if exc.errno == errno.ENOSPC:
        return OutputError(f"disk full writing {path}; free space and restart the worker")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return OutputError(f"cannot write {path}: {exc.strerror}; check the output directory")
    return OutputError(f"writing {path} failed: {exc}")
