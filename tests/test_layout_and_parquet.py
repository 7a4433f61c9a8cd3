"""Output layout (segment names) and the Parquet sink: two-phase writes, the
contract's schema and metadata, temp-file hygiene and error mapping."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.embedder import ModelInfo
from pipeline.errors import OutputError
from pipeline.records import GoodRecord, SourceRecord
from sinks import parquet as parquet_mod
from sinks.layout import SegmentName, iter_segments, vectors_dir, written_high_offsets
from sinks.parquet import ParquetSink, output_error, remove_stale_temp_files

DIM = 8
MODEL = ModelInfo(
    name="sentence-transformers/all-MiniLM-L6-v2",
    path="/models/minilm",
    revision="sha256:0123456789abcdef",
    dim=DIM,
    pooling="mean",
    normalize=True,
    max_length=256,
    precision="fp32",
    device="cpu",
)


def records(topic: str, partition: int, offsets: list[int]) -> list[GoodRecord]:
    out = []
    for i, offset in enumerate(offsets):
        key = None if i % 2 else f"key-{offset}".encode()
        record_id = None if i % 3 == 2 else f"id-{offset}"
        metadata = json.dumps({"n": offset}) if i % 2 else None
        source = SourceRecord(topic, partition, offset, 1_700_000_000_000 + offset, key, b"{}")
        out.append(GoodRecord(source, f"text number {offset} é", record_id, metadata))
    return out


def unit_vectors(n: int, dim: int = DIM, seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.fixture
def sink(tmp_path: Path) -> ParquetSink:
    s = ParquetSink(tmp_path, MODEL)
    s.prepare()
    return s


# ------------------------------------------------------------------ SegmentName


@pytest.mark.parametrize(
    "topic",
    [
        "t",
        "my-topic",
        "my.topic.v2",
        "a-b-c.d_e",
        "tricky-p00001-00000000000000000001-00000000000000000002",
        "ends-with-dash-",
    ],
)
@pytest.mark.parametrize(
    ("partition", "first", "last"), [(0, 0, 0), (7, 10, 99), (65535, 0, (1 << 40) - 1)]
)
def test_segment_name_round_trip(topic: str, partition: int, first: int, last: int) -> None:
    name = SegmentName(topic, partition, first, last)
    assert name.filename.endswith(".parquet")
    assert SegmentName.parse(name.filename) == name


@pytest.mark.parametrize(
    "filename",
    [
        "index.json",
        "t-p00000-00000000000000000000-00000000000000000009.parquet.tmp",
        ".t-p00000-00000000000000000000-00000000000000000009.parquet.host.1.ab.tmp",
        "t-p0-0-9.parquet",
        "-p00000-00000000000000000000-00000000000000000009.parquet",
        "t-p00000-00000000000000000000-00000000000000000009.parq",
    ],
)
def test_segment_name_parse_rejects_other_files(filename: str) -> None:
    assert SegmentName.parse(filename) is None


def test_segment_names_sort_by_offset_within_partition() -> None:
    names = [SegmentName("t", 0, 100, 199), SegmentName("t", 0, 2, 99), SegmentName("t", 0, 0, 1)]
    assert sorted(n.filename for n in names) == [n.filename for n in sorted(names)]


def test_written_high_offsets(tmp_path: Path) -> None:
    assert written_high_offsets(tmp_path) == {}  # no vectors dir yet
    directory = vectors_dir(tmp_path)
    directory.mkdir()
    for name in [
        SegmentName("a-b.c", 0, 0, 9),
        SegmentName("a-b.c", 0, 10, 19),
        SegmentName("a-b.c", 1, 0, 4),
        SegmentName("other", 0, 5, 5),
    ]:
        (directory / name.filename).write_bytes(b"")
    # unfinished and foreign files do not count
    (directory / f".{SegmentName('a-b.c', 0, 20, 29).filename}.h.1.ab.tmp").write_bytes(b"")
    (directory / "notes.txt").write_text("x")
    assert written_high_offsets(tmp_path) == {("a-b.c", 0): 19, ("a-b.c", 1): 4, ("other", 0): 5}
    assert [n for n, _ in iter_segments(tmp_path)][:2] == [
        SegmentName("a-b.c", 0, 0, 9),
        SegmentName("a-b.c", 0, 10, 19),
    ]


# ------------------------------------------------------------------ ParquetSink


def test_stage_writes_a_temp_file_that_is_not_a_segment(sink: ParquetSink, tmp_path: Path) -> None:
    name = SegmentName("topic.x", 2, 10, 14)
    staged = sink.stage(name, records("topic.x", 2, [10, 11, 13]), unit_vectors(3))
    assert staged.tmp_path.exists()
    assert not staged.tmp_path.name.endswith(".parquet")
    assert not staged.final_path.exists()
    assert staged.rows == 3
    assert list(iter_segments(tmp_path)) == []
    assert written_high_offsets(tmp_path) == {}


def test_publish_makes_a_readable_file_with_the_rows(sink: ParquetSink, tmp_path: Path) -> None:
    name = SegmentName("topic.x", 2, 10, 14)
    recs = records("topic.x", 2, [10, 11, 13, 14])
    vectors = unit_vectors(4)
    staged = sink.stage(name, recs, vectors)
    sink.publish(staged)
    assert not staged.tmp_path.exists()
    assert staged.final_path == vectors_dir(tmp_path) / name.filename
    assert [n for n, _ in iter_segments(tmp_path)] == [name]
    table = pq.read_table(staged.final_path)
    assert table.num_rows == 4
    assert table.column("topic").to_pylist() == ["topic.x"] * 4
    assert table.column("partition").to_pylist() == [2] * 4
    assert table.column("offset").to_pylist() == [10, 11, 13, 14]
    assert table.column("key").to_pylist() == [r.source.key for r in recs]
    assert table.column("key").null_count == 2
    assert table.column("id").to_pylist() == [r.record_id for r in recs]
    assert table.column("text").to_pylist() == [r.text for r in recs]
    assert table.column("timestamp").to_pylist() == [r.source.timestamp for r in recs]
    assert table.column("metadata").to_pylist() == [r.metadata for r in recs]
    emb = np.array(table.column("embedding").to_pylist(), dtype=np.float32)
    np.testing.assert_array_equal(emb, vectors)


def test_schema_types_per_contract(sink: ParquetSink) -> None:
    staged = sink.stage(SegmentName("t", 0, 0, 1), records("t", 0, [0, 1]), unit_vectors(2))
    sink.publish(staged)
    schema = pq.read_schema(staged.final_path)
    expected = {
        "topic": pa.string(),
        "partition": pa.int32(),
        "offset": pa.int64(),
        "key": pa.binary(),
        "id": pa.string(),
        "text": pa.string(),
        "timestamp": pa.int64(),
    }
    for column, type_ in expected.items():
        assert schema.field(column).type == type_, column
    assert schema.field("key").nullable and schema.field("id").nullable
    emb = schema.field("embedding").type
    assert pa.types.is_fixed_size_list(emb)
    assert emb.list_size == DIM
    assert emb.value_type == pa.float32()


def test_key_value_metadata_names_the_model(sink: ParquetSink) -> None:
    staged = sink.stage(SegmentName("t", 0, 0, 0), records("t", 0, [0]), unit_vectors(1))
    sink.publish(staged)
    raw = pq.read_schema(staged.final_path).metadata
    meta = {k.decode(): v.decode() for k, v in raw.items() if k.startswith(b"embedding.")}
    assert meta["embedding.model"] == MODEL.name
    assert meta["embedding.model_revision"] == MODEL.revision
    assert meta["embedding.precision"] == "fp32"
    assert meta["embedding.pooling"] == "mean"
    assert meta["embedding.normalization"] == "l2"
    assert meta["embedding.dim"] == str(DIM)


def test_segment_of_only_bad_records_is_a_valid_empty_file(
    sink: ParquetSink, tmp_path: Path
) -> None:
    name = SegmentName("t", 0, 5, 9)
    staged = sink.stage(name, [], np.empty((0, DIM), dtype=np.float32))
    sink.publish(staged)
    assert staged.rows == 0
    table = pq.read_table(staged.final_path)
    assert table.num_rows == 0
    assert table.schema.field("embedding").type.list_size == DIM
    assert written_high_offsets(tmp_path) == {("t", 0): 9}


def test_discard_removes_the_temp_file(sink: ParquetSink, tmp_path: Path) -> None:
    staged = sink.stage(SegmentName("t", 0, 0, 0), records("t", 0, [0]), unit_vectors(1))
    ParquetSink.discard(staged)
    assert not staged.tmp_path.exists()
    assert list(vectors_dir(tmp_path).iterdir()) == []


# ------------------------------------------------------------------ temp-file hygiene


def _tmp_name(host: str, pid: int, token: str = "deadbeef") -> str:
    return f".{SegmentName('t', 0, 0, 9).filename}.{host}.{pid}.{token}.tmp"


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_remove_stale_temp_files_only_removes_dead_writers(tmp_path: Path) -> None:
    host = parquet_mod._HOST
    live = subprocess.Popen(["sleep", "60"])
    try:
        dead_file = tmp_path / _tmp_name(host, _dead_pid())
        live_file = tmp_path / _tmp_name(host, live.pid)
        remote_file = tmp_path / _tmp_name("some_other_host", _dead_pid())
        segment = tmp_path / SegmentName("t", 0, 0, 9).filename
        for path in (dead_file, live_file, remote_file, segment):
            path.write_bytes(b"x")
        assert remove_stale_temp_files(tmp_path) == 1
        assert not dead_file.exists()
        assert live_file.exists()
        assert remote_file.exists()  # another machine's writer cleans its own files
        assert segment.exists()  # finished files are never touched
    finally:
        live.kill()
        live.wait()


def test_remove_stale_temp_files_same_pid_earlier_process(tmp_path: Path) -> None:
    # Same host and pid as us but another token: an earlier process (pid reuse).
    earlier = tmp_path / _tmp_name(parquet_mod._HOST, os.getpid(), "00000000")
    earlier.write_bytes(b"x")
    assert remove_stale_temp_files(tmp_path) == 1
    assert not earlier.exists()


def test_prepare_keeps_this_process_staged_file(sink: ParquetSink, tmp_path: Path) -> None:
    staged = sink.stage(SegmentName("t", 0, 0, 0), records("t", 0, [0]), unit_vectors(1))
    assert ParquetSink(tmp_path, MODEL).prepare() == 0
    assert staged.tmp_path.exists()


def test_prepare_removes_dead_writer_files_and_reports_count(tmp_path: Path) -> None:
    directory = vectors_dir(tmp_path)
    directory.mkdir()
    (directory / _tmp_name(parquet_mod._HOST, _dead_pid())).write_bytes(b"x")
    assert ParquetSink(tmp_path, MODEL).prepare() == 1
    assert list(directory.iterdir()) == []


# ------------------------------------------------------------------ errors


def test_prepare_on_unwritable_location_raises_output_error(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        # root ignores permission bits: put the output under a regular file instead
        blocker = tmp_path / "a-file"
        blocker.write_text("not a directory")
        output = blocker / "out"
    else:
        output = tmp_path / "ro"
        output.mkdir()
        (output / "vectors").mkdir()
        (output / "vectors").chmod(0o555)
    with pytest.raises(OutputError, match="not writable"):
        ParquetSink(output, MODEL).prepare()


def test_output_error_maps_errno_to_actionable_messages(tmp_path: Path) -> None:
    path = tmp_path / "f"
    full = output_error(OSError(errno.ENOSPC, "No space left on device"), path)
    assert isinstance(full, OutputError)
    assert "disk full" in str(full) and str(path) in str(full)
    denied = output_error(OSError(errno.EACCES, "Permission denied"), path)
    assert "cannot write" in str(denied) and "Permission denied" in str(denied)
    other = output_error(OSError(errno.EIO, "I/O error"), path)
    assert isinstance(other, OutputError) and str(path) in str(other)
    assert full.exit_code == OutputError.exit_code


def test_stage_on_full_disk_raises_output_error_and_leaves_no_temp(
    sink: ParquetSink, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(parquet_mod.os, "fsync", no_space)
    with pytest.raises(OutputError, match="disk full"):
        sink.stage(SegmentName("t", 0, 0, 0), records("t", 0, [0]), unit_vectors(1))
    assert list(vectors_dir(tmp_path).iterdir()) == []


def test_publish_failure_raises_output_error(sink: ParquetSink) -> None:
    staged = sink.stage(SegmentName("t", 0, 0, 0), records("t", 0, [0]), unit_vectors(1))
    staged.tmp_path.unlink()  # the rename source is gone
    with pytest.raises(OutputError):
        sink.publish(staged)
