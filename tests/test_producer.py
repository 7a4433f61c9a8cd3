"""`pipeline produce`: input readers report bad lines with their line numbers;
end to end (integration) the CLI publishes the good lines and skips or stops at
bad ones."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from kafka import KafkaConsumer, TopicPartition

from pipeline import cli
from pipeline.core.errors import ConfigError
from pipeline.kafka.producer import BadInputLine, InputRow, detect_format, read_rows


def rows(path: Path, fmt: str, text_field: str = "text") -> list[InputRow]:
    return list(read_rows(path, fmt, text_field))


def summary(result: list[InputRow]) -> list[tuple[int, bool]]:
    """(line, ok) per row."""
    return [(r.line, r.error is None) for r in result]


# ------------------------------------------------------------------ detect_format


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("a.jsonl", "jsonl"),
        ("a.ndjson", "jsonl"),
        ("a.json", "jsonl"),
        ("A.JSONL", "jsonl"),
        ("a.csv", "csv"),
        ("a.parquet", "parquet"),
        ("a.pq", "parquet"),
        ("a.txt", "text"),
        ("dir.v2/a.text", "text"),
    ],
)
def test_detect_format_from_suffix(name: str, fmt: str) -> None:
    assert detect_format(Path(name), "auto") == fmt


def test_declared_format_wins_over_suffix() -> None:
    assert detect_format(Path("data.csv"), "text") == "text"
    assert detect_format(Path("no-suffix"), "jsonl") == "jsonl"


@pytest.mark.parametrize("name", ["data", "data.xml", "data.jsonl.gz"])
def test_unknown_suffix_asks_for_format(name: str) -> None:
    with pytest.raises(ConfigError, match="--format"):
        detect_format(Path(name), "auto")


def test_missing_input_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        rows(tmp_path / "nope.jsonl", "jsonl")


# ------------------------------------------------------------------ readers


def test_jsonl_reports_bad_lines_with_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(
        "\n".join(
            [
                '{"text": "first", "id": "a"}',  # 1
                '{"text": "broken"',  # 2: invalid JSON
                "",  # 3: blank, not a record
                '["text", "list"]',  # 4: not an object
                '{"body": "no text field"}',  # 5
                '{"text": "   "}',  # 6: blank text
                '{"text": 5}',  # 7: not a string
                '{"text": "last", "extra": [1, 2]}',  # 8
            ]
        )
        + "\n",
        encoding="utf-8",
    )
    result = rows(path, "jsonl")
    assert summary(result) == [
        (1, True),
        (2, False),
        (4, False),
        (5, False),
        (6, False),
        (7, False),
        (8, True),
    ]
    assert result[0].obj == {"text": "first", "id": "a"}
    assert result[-1].obj == {"text": "last", "extra": [1, 2]}
    assert "invalid JSON" in (result[1].error or "")
    assert "list" in (result[2].error or "")
    assert all(r.obj is None for r in result if r.error)
    assert all(r.path == path for r in result)


def test_jsonl_past_pythons_json_limits_is_a_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    deep = "[" * 5000 + "]" * 5000
    long = "1" * 5000
    path.write_text(
        f'{{"text": "a"}}\n{{"text": "b", "x": {deep}}}\n{{"n": {long}}}\n{{"text": "c"}}\n'
    )
    result = rows(path, "jsonl")
    assert summary(result) == [(1, True), (2, False), (3, False), (4, True)]
    assert "nested too deeply" in (result[1].error or "")
    assert "4300 digits" in (result[2].error or "")


def test_jsonl_custom_text_field(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"body": "x"}\n{"text": "y"}\n')
    assert summary(rows(path, "jsonl", "body")) == [(1, True), (2, False)]


def test_jsonl_invalid_utf8_line_is_a_bad_line_with_its_number(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n{"text": "after"}\n')
    assert summary(rows(path, "jsonl")) == [(1, True), (2, False), (3, True)]


def test_csv_reports_bad_rows_with_file_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_text(
        "id,text\n"  # 1
        "a,hello world\n"  # 2
        'b,"a quoted, comma"\n'  # 3
        "c,\n"  # 4: empty text
        "d,too,many\n"  # 5: more fields than the header
        'e,"two\nlines"\n'  # 6-7
        "f,final\n",  # 8
        encoding="utf-8",
    )
    result = rows(path, "csv")
    assert summary(result) == [(2, True), (3, True), (4, False), (5, False), (7, True), (8, True)]
    assert result[1].obj == {"id": "b", "text": "a quoted, comma"}
    assert result[4].obj == {"id": "e", "text": "two\nlines"}
    assert "more fields" in (result[3].error or "")


def test_csv_without_text_column_stops(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_text("id,body\n1,x\n")
    with pytest.raises(BadInputLine, match="'text' column"):
        rows(path, "csv")


def test_parquet_rows_numbered_from_one(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    table = pa.table({"text": ["one", None, "", "four"], "n": [1, 2, 3, 4]})
    pq.write_table(table, path)
    result = rows(path, "parquet")
    assert summary(result) == [(1, True), (2, False), (3, False), (4, True)]
    assert result[3].obj == {"text": "four", "n": 4}


def test_parquet_without_text_column_stops(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"body": ["x"]}), path)
    with pytest.raises(BadInputLine, match="no 'text' column"):
        rows(path, "parquet")


def test_text_one_record_per_non_blank_line(tmp_path: Path) -> None:
    path = tmp_path / "in.txt"
    path.write_text("first line\n\n   \nsecond, with {json-ish} chars\nno newline at end")
    result = rows(path, "text", "body")
    assert summary(result) == [(1, True), (4, True), (5, True)]
    assert [r.obj for r in result] == [
        {"body": "first line"},
        {"body": "second, with {json-ish} chars"},
        {"body": "no newline at end"},
    ]


# ------------------------------------------------------------------ integration


def read_topic(broker: str, topic: str) -> list[dict]:
    consumer = KafkaConsumer(
        bootstrap_servers=broker, group_id=None, enable_auto_commit=False, consumer_timeout_ms=5000
    )
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        end = consumer.end_offsets(partitions)
        out: list[dict] = []
        while any(consumer.position(tp) < end[tp] for tp in partitions):
            batch = consumer.poll(timeout_ms=1000)
            for records in batch.values():
                out += [json.loads(r.value) for r in records]
        return out
    finally:
        consumer.close()


def jsonl_with_one_bad_line(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"id": f"d{i}", "text": f"document number {i}"}) for i in range(5)]
    lines.insert(3, '{"id": "bad", "text": ')  # line 4
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.integration
def test_produce_skips_bad_line_by_default(
    broker: str, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic = make_topic(partitions=2)
    path = jsonl_with_one_bad_line(tmp_path)
    result = CliRunner().invoke(
        cli.main, ["--bootstrap-servers", broker, "produce", topic, str(path)]
    )
    assert result.exit_code == 0, result.output
    assert f"{path}:4" in result.stderr
    assert "published 5 records" in result.stdout
    published = read_topic(broker, topic)
    assert sorted(r["id"] for r in published) == [f"d{i}" for i in range(5)]
    assert {r["text"] for r in published} == {f"document number {i}" for i in range(5)}


@pytest.mark.integration
def test_produce_stop_on_bad_exits_non_zero_naming_the_line(
    broker: str, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic = make_topic()
    path = jsonl_with_one_bad_line(tmp_path)
    args = ["--bootstrap-servers", broker, "produce", topic, str(path), "--stop-on-bad"]
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code != 0
    assert result.exit_code == BadInputLine.exit_code
    assert f"{path}:4" in result.stderr
    assert "Traceback" not in result.output
    # nothing past the bad line was published
    assert all(r["id"] in {"d0", "d1", "d2"} for r in read_topic(broker, topic))
