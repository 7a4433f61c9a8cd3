"""RecordParser: every bad kind of the contract becomes a BadRecord with its
stage and class; good records keep text, id and the other fields as metadata."""

from __future__ import annotations

import json

import pytest

from pipeline.core.records import (
    STAGE_DECODE,
    STAGE_VALIDATE,
    BadRecord,
    GoodRecord,
    RecordParser,
    SourceRecord,
)


def source(value: bytes | None, key: bytes | None = b"k", offset: int = 7) -> SourceRecord:
    return SourceRecord("topic-a", 3, offset, 1_700_000_000_000, key, value)


def parse(value: bytes | None, parser: RecordParser | None = None) -> GoodRecord | BadRecord:
    return (parser or RecordParser()).parse(source(value))


def js(obj: object) -> bytes:
    return json.dumps(obj).encode("utf-8")


@pytest.mark.parametrize(
    ("value", "stage", "error_class"),
    [
        pytest.param(None, STAGE_DECODE, "Tombstone", id="tombstone"),
        pytest.param(b'{"text": "caf\xe9"}', STAGE_DECODE, "InvalidUtf8", id="latin1"),
        pytest.param(b"\xff\xfe\x00t", STAGE_DECODE, "InvalidUtf8", id="garbage-bytes"),
        pytest.param(b'{"text": "unterminated', STAGE_DECODE, "InvalidJson", id="truncated"),
        pytest.param(b"not json at all", STAGE_DECODE, "InvalidJson", id="plain-text"),
        pytest.param(b"", STAGE_DECODE, "InvalidJson", id="empty-bytes"),
        pytest.param(js(["text", "x"]), STAGE_VALIDATE, "NotAnObject", id="list"),
        pytest.param(js("just a string"), STAGE_VALIDATE, "NotAnObject", id="string"),
        pytest.param(js(42), STAGE_VALIDATE, "NotAnObject", id="number"),
        pytest.param(b"null", STAGE_VALIDATE, "NotAnObject", id="json-null"),
        pytest.param(js({"body": "hello"}), STAGE_VALIDATE, "MissingText", id="missing"),
        pytest.param(js({"text": None}), STAGE_VALIDATE, "MissingText", id="null-text"),
        pytest.param(js({"text": 12}), STAGE_VALIDATE, "TextNotString", id="int-text"),
        pytest.param(js({"text": ["a"]}), STAGE_VALIDATE, "TextNotString", id="list-text"),
        pytest.param(js({"text": {"a": 1}}), STAGE_VALIDATE, "TextNotString", id="obj-text"),
        pytest.param(js({"text": ""}), STAGE_VALIDATE, "EmptyText", id="empty"),
        pytest.param(js({"text": " \t\n\u3000 "}), STAGE_VALIDATE, "EmptyText", id="blank"),
    ],
)
def test_bad_kinds(value: bytes | None, stage: str, error_class: str) -> None:
    result = parse(value)
    assert isinstance(result, BadRecord)
    assert (result.stage, result.error_class) == (stage, error_class)
    assert result.message  # a human-readable reason for the dead-letter header
    # the source travels unchanged, so the DLQ gets the original key and value bytes
    assert result.source == source(value)


def test_text_size_cap_counts_utf8_bytes_not_characters() -> None:
    parser = RecordParser(max_text_bytes=10)
    at_cap = "é" * 5  # 5 characters, 10 bytes
    over_cap = "é" * 6  # 6 characters (under 10), 12 bytes
    assert isinstance(parse(js({"text": at_cap}), parser), GoodRecord)
    result = parse(json.dumps({"text": over_cap}, ensure_ascii=False).encode(), parser)
    assert isinstance(result, BadRecord)
    assert (result.stage, result.error_class) == (STAGE_VALIDATE, "TextTooLarge")
    assert "12" in result.message


def test_text_size_cap_default_is_64_kib() -> None:
    assert isinstance(parse(js({"text": "a" * 65_536})), GoodRecord)
    result = parse(js({"text": "a" * 65_537}))
    assert isinstance(result, BadRecord) and result.error_class == "TextTooLarge"
    # 4-byte characters: 16,385 of them are 65,540 bytes
    result = parse(js({"text": "\U0001f600" * 16_385}))
    assert isinstance(result, BadRecord) and result.error_class == "TextTooLarge"


def test_lone_surrogate_text_is_a_bad_record_not_a_crash() -> None:
    # Valid UTF-8 bytes and valid JSON, but "\ud800" decodes to an unpaired surrogate.
    result = parse(b'{"text": "abc \\ud800 def"}')
    assert isinstance(result, BadRecord)
    assert result.error_class == "InvalidUnicode"


@pytest.mark.parametrize(
    "value",
    [b'{"text": "ok", "id": "a\\ud800"}', b'{"text": "ok", "note": "x\\udc00y"}'],
    ids=["id", "metadata"],
)
def test_lone_surrogate_elsewhere_is_a_bad_record_not_a_sink_failure(value: bytes) -> None:
    # pyarrow could not write such a string as UTF-8: the record must go to the
    # dead-letter topic at parsing, never reach the sink.
    result = parse(value)
    assert isinstance(result, BadRecord)
    assert result.error_class == "InvalidUnicode"


def test_good_record_keeps_text_id_and_source() -> None:
    value = js({"text": "The quick brown fox.", "id": "doc-1"})
    result = parse(value)
    assert isinstance(result, GoodRecord)
    assert result.text == "The quick brown fox."
    assert result.record_id == "doc-1"
    assert result.metadata is None
    assert result.source == source(value)


def test_text_is_kept_verbatim_including_surrounding_whitespace() -> None:
    result = parse(js({"text": "  padded text\n"}))
    assert isinstance(result, GoodRecord) and result.text == "  padded text\n"


@pytest.mark.parametrize(("raw", "expected"), [(17, "17"), (-3, "-3"), (2.5, "2.5")])
def test_numeric_id_becomes_string(raw: object, expected: str) -> None:
    result = parse(js({"text": "t", "id": raw}))
    assert isinstance(result, GoodRecord)
    assert result.record_id == expected


def test_missing_or_null_id_is_none() -> None:
    for obj in ({"text": "t"}, {"text": "t", "id": None}):
        result = parse(js(obj))
        assert isinstance(result, GoodRecord) and result.record_id is None


def test_other_fields_end_up_in_metadata_json() -> None:
    obj = {"text": "t", "id": "x", "source": "λ-module", "n": 3, "tags": ["a", "b"]}
    result = parse(json.dumps(obj, ensure_ascii=False).encode())
    assert isinstance(result, GoodRecord)
    assert result.metadata is not None
    assert json.loads(result.metadata) == {"source": "λ-module", "n": 3, "tags": ["a", "b"]}


def test_custom_text_and_id_fields() -> None:
    parser = RecordParser(text_field="body", id_field="doc_id")
    obj = {"body": "custom body", "doc_id": 99, "text": "not the text", "id": "not the id"}
    result = parse(js(obj), parser)
    assert isinstance(result, GoodRecord)
    assert result.text == "custom body"
    assert result.record_id == "99"
    assert result.metadata is not None
    assert json.loads(result.metadata) == {"text": "not the text", "id": "not the id"}


def test_custom_text_field_missing_is_bad_even_if_default_field_present() -> None:
    result = parse(js({"text": "hello"}), RecordParser(text_field="body"))
    assert isinstance(result, BadRecord)
    assert result.error_class == "MissingText"
    assert "body" in result.message


def test_unicode_text_roundtrips() -> None:
    text = "Grüße, 世界 — naïve café 😀"
    result = parse(json.dumps({"text": text}, ensure_ascii=False).encode("utf-8"))
    assert isinstance(result, GoodRecord) and result.text == text


@pytest.mark.parametrize(
    "value",
    [
        b'{"text": "hi", "score": NaN}',
        b'{"text": "hi", "big": 123456789012345678901234567890}',
        b'{"text": "hi", "n": -9223372036854775809, "m": 18446744073709551616}',
        b'{"text": "1234567890123456789", "n": [9999999999999999999]}',
        b'{"text": "hi", "n": 999999999999999999, "f": 0.0000000000000000001}',
        b'\xef\xbb\xbf{"text": "hi"}',
        b'{"text": "hi", "text": "again"}',
        b'{"text": "a\\u00e9\\ud83d\\ude00", "n": 1e400}',
        b'  {"text": "hi"}\n',
        b'{"text": "hi", "m": {"deep": [18446744073709551616, 0.5]}}',
        b'{"text": "hi", "id": 123456789012345678901234567890, "ok": true, "none": null}',
        b'{"text": "hi", "f": 1.5, "g": -12345678901234567890}',
        b'{"text": "hi", "f": 1.5, "edge": 18446744073709551615, "low": -9223372036854775808}',
    ],
)
def test_the_fast_parser_accepts_and_rejects_what_json_does(value: bytes) -> None:
    """orjson parses; the standard json module stays the judge of what is valid."""
    try:
        expected: object = json.loads(value.decode("utf-8"))
    except json.JSONDecodeError:
        expected = None
    result = parse(value)
    if expected is None:
        assert isinstance(result, BadRecord) and result.error_class == "InvalidJson"
    else:
        assert isinstance(result, GoodRecord)
        assert isinstance(expected, dict)
        assert result.text == expected["text"]
        rest = {k: v for k, v in expected.items() if k != "text"}
        rest = {k: v for k, v in expected.items() if k not in ("text", "id")}
        # Integers past 64 bits kept exact (orjson would have made them floats).
        finite = json.loads(json.dumps(rest).replace("NaN", "null").replace("Infinity", "null"))
        assert result.metadata == (json.dumps(finite, ensure_ascii=False) if rest else None)
        expected_id = expected.get("id")
        assert result.record_id == (None if expected_id is None else json.dumps(expected_id))


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (b"18446744073709551616", "int"),  # orjson reads a float
        (b"[18446744073709551616]", "list"),
        (b'["\\ud800"]', "list"),  # a lone surrogate, but not an object first
        (b'"text"', "str"),
        (b"NaN", "float"),
    ],
)
def test_values_that_are_not_objects_are_named_as_json_reads_them(value: bytes, kind: str) -> None:
    result = parse(value)
    assert isinstance(result, BadRecord) and result.error_class == "NotAnObject"
    assert result.message == f"value is a JSON {kind}"


@pytest.mark.parametrize("depth", [500, 1_000, 1_030, 100_000])
@pytest.mark.parametrize("where", ["value", "id", "metadata"])
def test_json_nested_past_the_recursion_limit_is_a_bad_record(depth: int, where: str) -> None:
    """orjson reads up to 1,024 levels, Python's json about 1,000 (each way): a value
    nested deeper was a RecursionError that stopped the worker, on every restart."""
    nested = b"[" * depth + b"]" * depth
    value = {
        "value": nested,
        "id": b'{"text": "ok", "id": ' + nested + b"}",
        "metadata": b'{"text": "ok", "tags": ' + nested + b"}",
    }[where]
    result = parse(value)
    if depth > 1_024 or (where != "value" and depth >= 1_000):
        assert isinstance(result, BadRecord)
        assert (result.stage, result.error_class) == (STAGE_DECODE, "NestedTooDeep")
        assert result.message and result.source == source(value)
    elif where == "value":  # read: a JSON array
        assert isinstance(result, BadRecord) and result.error_class == "NotAnObject"
    else:  # read and written back whole
        assert isinstance(result, GoodRecord)
        written = result.record_id if where == "id" else result.metadata
        assert written is not None and written.count("[") == depth


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(b'{"text": "a", "n": ' + b"1" * 5000 + b"}", id="metadata"),
        pytest.param(b'{"text": "a", "id": -' + b"9" * 4400 + b"}", id="id"),
    ],
)
def test_integers_over_pythons_digit_limit_are_bad_records(value: bytes) -> None:
    """An integer of over 4,300 digits was a ValueError that stopped the worker."""
    result = parse(value)
    assert isinstance(result, BadRecord)
    assert (result.error_class, result.stage) == ("NumberOutOfRange", STAGE_DECODE)
    assert "4300 digits" in result.message and result.source == source(value)


def test_long_integers_within_pythons_limit_are_kept_exactly() -> None:
    digits = "7" * 4000
    result = parse(b'{"text": "a", "id": ' + digits.encode() + b', "n": -' + digits.encode() + b"}")
    assert isinstance(result, GoodRecord)
    assert result.record_id == digits
    assert json.loads(result.metadata or "") == {"n": -int(digits)}


def test_nan_and_infinities_are_kept_as_null_in_metadata() -> None:
    """Python producers write NaN and Infinity (json.dumps does by default) and json
    reads them, as it reads 1e999 as infinity: the record is kept, and its metadata
    stays JSON that strict readers take (it had held `NaN` tokens)."""
    result = parse(b'{"text": "a", "s": NaN, "m": {"l": [1.5, -Infinity, 1e999]}, "x": 2}')
    assert isinstance(result, GoodRecord)
    assert result.metadata == '{"s": null, "m": {"l": [1.5, null, null]}, "x": 2}'
    json.loads(result.metadata, parse_constant=lambda name: pytest.fail(f"{name} written"))
