"""Documents by key (`pipeline run --write-mode upsert`): which document a record is
a version of, and which records delete one.

In upsert mode every record names a document: by its `--id-field` value, or by its
Kafka key where it has none (`--document-key id`, the default), or always by its
Kafka key (`--document-key kafka-key`). A tombstone (a null value) deletes the
document its Kafka key names. A record that names no document, or one past the key
bound, is a bad record with a class of its own; the parser's other verdicts stand.

The key is computed here, once, from what the record carries, so the segment writer
(sinks.parquet) and the dead-letter decision always agree on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pipeline.core.chunks import later_chunk
from pipeline.core.records import STAGE_VALIDATE, BadRecord, GoodRecord, Source

T = TypeVar("T")

APPEND = "append"
UPSERT = "upsert"
WRITE_MODES = (APPEND, UPSERT)

BY_ID = "id"
BY_KAFKA_KEY = "kafka-key"
DOCUMENT_KEYS = (BY_ID, BY_KAFKA_KEY)

# Segment columns of upsert mode: the document a row is a version of, and whether
# the row deletes it (a tombstone's row: no text, a zero vector, never indexed).
DOC_KEY = "doc_key"
DELETED = "deleted"

TOMBSTONE = "Tombstone"  # the parser's class for a null value
MISSING_KEY = "MissingDocumentKey"
KEY_TOO_LONG = "DocumentKeyTooLong"
KEY_NOT_UTF8 = "DocumentKeyNotUtf8"


@dataclass(slots=True)
class Deletion:
    """A tombstone in upsert mode: deletes the document `key`."""

    source: Source
    key: str


Keyed = GoodRecord | BadRecord | Deletion


@dataclass(frozen=True)
class DocumentKeys:
    """How a record names its document; `max_bytes` bounds a key in UTF-8."""

    by: str = BY_ID
    max_bytes: int = 1024

    def key_of(self, record: GoodRecord) -> str | None:
        """The document a good record is a version of (None: it names none, or its
        Kafka key is not UTF-8; `keyed` has sent such records to the dead letters)."""
        if self.by == BY_ID and record.record_id is not None:
            return record.record_id
        key = _kafka_key_or_error(record.source)
        return key if isinstance(key, str) else None

    def keyed(self, parsed: Iterable[GoodRecord | BadRecord]) -> list[Keyed]:
        """The parser's verdicts in upsert mode: tombstones become deletions, and
        records without a usable document key become bad records."""
        return [self._keyed(p) for p in parsed]

    def _keyed(self, record: GoodRecord | BadRecord) -> Keyed:
        source = record.source
        if isinstance(record, BadRecord):
            if record.error_class != TOMBSTONE:
                return record
            key = _kafka_key_or_error(source)
            return self._problem(source, key) or Deletion(source, key)  # type: ignore[arg-type]
        if self.by == BY_ID and record.record_id is not None:
            key = record.record_id
        else:
            key = _kafka_key_or_error(source)
        return self._problem(source, key) or record

    def _problem(self, source: Source, key: str | BadRecord | None) -> BadRecord | None:
        """Why `key` cannot name a document, as a bad record; None: it can."""
        if isinstance(key, BadRecord):
            return key
        if not key:  # none, or empty
            what = "a tombstone" if source.value is None else "a record"
            named = "" if self.by == BY_KAFKA_KEY or source.value is None else " and no id"
            return BadRecord(
                source, STAGE_VALIDATE, MISSING_KEY, f"{what} without a Kafka key{named}: "
                "upsert mode cannot tell which document it is",
            )  # fmt: skip
        size = len(key.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            return BadRecord(
                source, STAGE_VALIDATE, KEY_TOO_LONG,
                f"document key is {size} bytes, over the bound of {self.max_bytes}",
            )  # fmt: skip
        return None


def _kafka_key_or_error(source: Source) -> str | BadRecord | None:
    if source.key is None:
        return None
    try:
        return source.key.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BadRecord(
            source, STAGE_VALIDATE, KEY_NOT_UTF8, f"Kafka key is not UTF-8 ({exc}): "
            "upsert mode keys documents by text",
        )  # fmt: skip


def paired(
    parsed: Sequence[GoodRecord | BadRecord],
    token_ids: Sequence[T],
    documents: DocumentKeys | None = None,
) -> list[tuple[Keyed, T | None]]:
    """Each good record with its token ids (`token_ids`: the parser's good records', in
    order), keyed by `documents` in upsert mode (paired first: keying may turn some bad)."""
    ids = iter(token_ids)
    tokens = [next(ids) if isinstance(p, GoodRecord) else None for p in parsed]
    if documents is None:
        return list(zip(parsed, tokens, strict=True))
    keyed = documents.keyed(parsed)
    return [
        (k, t if isinstance(k, GoodRecord) else None)
        for p, k, t in zip(parsed, keyed, tokens, strict=True)
        if isinstance(k, GoodRecord) or not later_chunk(p)  # a bad record is one, not a chunk
    ]
