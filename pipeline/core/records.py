"""Input records: a Kafka record becomes either a `GoodRecord` or a `BadRecord`.

Bad records are data, not exceptions: they travel through the batch beside the
good ones and end in the dead-letter topic with their context.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from typing import Any, NamedTuple, Protocol

import orjson

from pipeline.core.chunks import Span

# 19 digits in a row (an integer that may not fit 64 bits), found as 19 zeros once
# every digit reads "0": two C passes, a tenth of what a regex scan cost.
_ALL_DIGITS_ZERO = bytes.maketrans(b"123456789", b"0" * 9)
_LONG_DIGITS = b"0" * 19
# What orjson reads exactly as json does (an integer past 64 bits becomes a float).
_EXACT_TYPES = frozenset({str, int, bool, type(None)})
_NOT_PARSED = object()

# error.stage header values
STAGE_DECODE = "decode"
STAGE_VALIDATE = "validate"

NESTED_TOO_DEEP = "NestedTooDeep"
NUMBER_OUT_OF_RANGE = "NumberOutOfRange"
_TOO_DEEP_MESSAGE = "value is JSON nested too deeply to read or write back (about 1,000 levels)"


class Source(Protocol):
    """A consumed record, as the worker reads it: kafka-python's ConsumerRecord as
    polled (not copied: a copy per record was 2 % of the worker's CPU), or a
    `SourceRecord` where the worker builds one."""

    @property
    def topic(self) -> str: ...

    @property
    def partition(self) -> int: ...

    @property
    def offset(self) -> int: ...

    @property
    def timestamp(self) -> int: ...

    @property
    def key(self) -> bytes | None: ...

    @property
    def value(self) -> bytes | None: ...


# Not frozen: a frozen dataclass's __init__ costs several times a plain one's, paid
# for every record; nothing mutates these after parsing.
@dataclass(slots=True)
class SourceRecord:
    """What the worker keeps of a consumed Kafka record."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None


class GoodRecord(NamedTuple):
    """A record to embed. A tuple: made in bulk from a tokenizer process's columns
    (`good_records`) at a tenth of a dataclass's cost, in the poll loop's GIL."""

    source: Source
    text: str
    record_id: str | None
    metadata: str | None  # the other JSON fields, re-serialised
    # A chunk of the record's text, or the whole text cut by the model's length
    # (pipeline.core.chunks); None: the whole text, embedded whole.
    span: Span | None = None


_new_good_record = partial(tuple.__new__, GoodRecord)


def good_records(
    sources: Iterable[Source],
    texts: Iterable[str],
    record_ids: Iterable[str | None],
    metadatas: Iterable[str | None],
) -> list[GoodRecord]:
    """GoodRecords from columns, without a Python call a record."""
    columns = zip(sources, texts, record_ids, metadatas, repeat(None), strict=False)
    return list(map(_new_good_record, columns))


@dataclass(slots=True)
class BadRecord:
    source: Source
    stage: str
    error_class: str
    message: str


@dataclass(frozen=True)
class RecordParser:
    """Validates record values against the contract's input format."""

    text_field: str = "text"
    id_field: str = "id"
    max_text_bytes: int = 65_536

    def parse(self, source: Source) -> GoodRecord | BadRecord:
        try:
            return self._parse(source)
        # Valid JSON past what Python's json reads or writes back is a bad record,
        # not a worker stopped on it at every restart.
        except RecursionError:  # nested past ~1,000 levels (orjson stops at 1,024)
            return _bad(source, STAGE_DECODE, NESTED_TOO_DEEP, _TOO_DEEP_MESSAGE)
        except UnicodeError as exc:
            return _bad(source, STAGE_DECODE, "InvalidUnicode", f"value cannot be UTF-8: {exc}")
        except ValueError as exc:  # an integer over 4,300 digits (Python's limit)
            return _bad(source, STAGE_DECODE, NUMBER_OUT_OF_RANGE, f"value holds {exc}")

    def _parse(self, source: Source) -> GoodRecord | BadRecord:
        value = source.value
        if value is None:
            return _bad(source, STAGE_DECODE, "Tombstone", "null value (tombstone)")
        obj = _parse_exactly(value)
        if obj is _NOT_PARSED:
            # json judges what orjson refused, or read inexactly, and words the error.
            try:
                decoded = value.decode("utf-8")
            except UnicodeDecodeError as exc:
                return _bad(source, STAGE_DECODE, "InvalidUtf8", f"value is not UTF-8: {exc}")
            try:
                obj = json.loads(decoded)
            except json.JSONDecodeError as exc:
                return _bad(source, STAGE_DECODE, "InvalidJson", f"value is not JSON: {exc}")
            if isinstance(obj, dict) and "\\u" in decoded and not _encodable(obj):
                # A JSON escape of a lone surrogate ("\ud800") decodes to a string
                # that cannot be written as UTF-8 anywhere downstream.
                return _bad(
                    source, STAGE_DECODE, "InvalidUnicode", "value has an unpaired surrogate escape"
                )
        if not isinstance(obj, dict):
            kind = type(obj).__name__
            return _bad(source, STAGE_VALIDATE, "NotAnObject", f"value is a JSON {kind}")
        return self._validate(source, obj)

    def _validate(self, source: Source, obj: dict[str, Any]) -> GoodRecord | BadRecord:
        text = obj.get(self.text_field)
        if text is None:
            return _bad(source, STAGE_VALIDATE, "MissingText", f"no {self.text_field!r} field")
        if not isinstance(text, str):
            kind = type(text).__name__
            return _bad(source, STAGE_VALIDATE, "TextNotString", f"{self.text_field!r} is a {kind}")
        if not text or text.isspace():
            return _bad(source, STAGE_VALIDATE, "EmptyText", f"{self.text_field!r} is blank")
        # A character is at most 4 bytes in UTF-8: short texts need no encoding to tell.
        if len(text) > self.max_text_bytes // 4:
            size = len(text.encode("utf-8"))
            if size > self.max_text_bytes:
                return _bad(
                    source,
                    STAGE_VALIDATE,
                    "TextTooLarge",
                    f"text is {size} bytes, over the cap of {self.max_text_bytes}",
                )
        record_id = obj.get(self.id_field)
        if record_id is not None and not isinstance(record_id, str):
            # Numeric ids are common upstream; keep them, as strings.
            record_id = json.dumps(record_id)
        metadata = None
        if len(obj) > (self.id_field in obj) + 1:  # fields besides text and id
            rest = {k: v for k, v in obj.items() if k != self.text_field and k != self.id_field}
            metadata = _metadata_json(rest)
        return GoodRecord(source, text, record_id, metadata)


def _parse_exactly(value: bytes) -> Any:
    """The value as orjson reads it where that is exactly how json reads it, else
    `_NOT_PARSED`.

    orjson refuses invalid UTF-8, NaN and lone surrogate escapes, which leaves them
    to json (which judges and words the error), and reads an integer past 64 bits
    as a float: a value whose fields are all strings, exact integers, booleans or
    nulls lost nothing; any other is parsed by json where it holds 19 digits in a row.
    """
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError:
        return _NOT_PARSED
    if type(obj) is dict:
        for field_value in obj.values():
            if type(field_value) not in _EXACT_TYPES:
                break
        else:
            return obj
    if _LONG_DIGITS in value.translate(_ALL_DIGITS_ZERO):
        return _NOT_PARSED
    return obj


def _metadata_json(fields: dict[str, Any]) -> str:
    """The fields as strict JSON. NaN and infinities (which Python producers write and
    json reads, as does 1e999) become null, as pandas writes them: strict readers
    (JavaScript, DuckDB) refuse a `NaN` token, and the record is worth keeping."""
    try:
        return json.dumps(fields, ensure_ascii=False, allow_nan=False)
    except ValueError:  # or an integer too long to write: raised again below
        return json.dumps(_finite(fields), ensure_ascii=False, allow_nan=False)


def _finite(value: Any) -> Any:
    if type(value) is float:
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _encodable(obj: Any) -> bool:
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bad(source: Source, stage: str, error_class: str, message: str) -> BadRecord:
    return BadRecord(source, stage, error_class, message)
