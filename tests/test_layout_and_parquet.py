"""Output layout (segment names) and the Parquet sink: two-phase writes, the
contract's schema and metadata, temp-file hygiene and error mapping."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import OutputError
from pipeline.core.layout import (
    SegmentFile,
    SegmentKey,
    iter_segments,
    quarantine_dir,
    segments_by_partition,
    vectors_dir,
)
from pipeline.core.model_info import ModelInfo
from pipeline.core.records import GoodRecord, SourceRecord
from sinks import parquet as parquet_mod
from sinks import writers
from sinks.parquet import ParquetSink, output_error
from sinks.segments import DamagedSegment, covered_through, pending_notes, quarantine, read_info
from sinks.writers import remove_stale_temp_files

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


# ------------------------------------------------------------------ segment names


def stage(sink: ParquetSink, topic: str, partition: int, first: int, last: int, offsets: list[int]):
    """Stages offsets first..last of which `offsets` are good records."""
    return sink.stage(
        SegmentKey(topic, partition, first),
        last,
        records(topic, partition, offsets),
        unit_vectors(len(offsets)),
        consumed=len(offsets),
    )


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
@pytest.mark.parametrize(("partition", "first"), [(0, 0), (7, 10), (65535, (1 << 40) - 1)])
def test_segment_key_round_trip(tmp_path: Path, topic: str, partition: int, first: int) -> None:
    key = SegmentKey(topic, partition, first)
    assert key.filename.endswith(".parquet")
    parsed = SegmentFile.parse(tmp_path / key.filename)
    assert parsed is not None and parsed.key == key and parsed.named_last is None


def test_legacy_names_with_a_last_offset_are_still_read(tmp_path: Path) -> None:
    legacy = SegmentFile.parse(
        tmp_path / "my-topic-p00003-00000000000000000010-00000000000000000019.parquet"
    )
    assert legacy is not None
    assert legacy.key == SegmentKey("my-topic", 3, 10)
    assert legacy.named_last == 19


@pytest.mark.parametrize(
    "filename",
    [
        "index.json",
        "t-p00000-00000000000000000000.parquet.tmp",
        ".t-p00000-00000000000000000000.parquet.host.1.ab.tmp",
        "t-p0-0.parquet",
        "-p00000-00000000000000000000.parquet",
        "t-p00000-00000000000000000000.parq",
    ],
)
def test_segment_parse_rejects_other_files(tmp_path: Path, filename: str) -> None:
    assert SegmentFile.parse(tmp_path / filename) is None


def test_segments_by_partition_sorts_by_offset_and_ignores_other_files(tmp_path: Path) -> None:
    assert segments_by_partition(tmp_path) == {}  # no vectors dir yet
    directory = vectors_dir(tmp_path)
    directory.mkdir()
    for key in [SegmentKey("a-b.c", 0, 100), SegmentKey("a-b.c", 0, 2), SegmentKey("o", 1, 5)]:
        (directory / key.filename).write_bytes(b"")
    (directory / f".{SegmentKey('a-b.c', 0, 200).filename}.h.1.ab.tmp").write_bytes(b"")
    (directory / "notes.txt").write_text("x")
    found = segments_by_partition(tmp_path)
    assert [s.key.first for s in found[("a-b.c", 0)]] == [2, 100]
    assert set(found) == {("a-b.c", 0), ("o", 1)}
    assert set(segments_by_partition(tmp_path, ["o"])) == {("o", 1)}


# ------------------------------------------------------------------ ParquetSink


def test_stage_writes_a_temp_file_that_is_not_a_segment(sink: ParquetSink, tmp_path: Path) -> None:
    staged = stage(sink, "topic.x", 2, 10, 14, [10, 11, 13])
    assert staged.tmp_path.exists()
    assert not staged.tmp_path.name.endswith(".parquet")
    assert not staged.final_path.exists()
    assert staged.rows == 3
    assert list(iter_segments(tmp_path)) == []


def test_publish_makes_a_readable_file_with_the_rows_and_its_range(
    sink: ParquetSink, tmp_path: Path
) -> None:
    recs = records("topic.x", 2, [10, 11, 13, 14])
    vectors = unit_vectors(4)
    key = SegmentKey("topic.x", 2, 10)
    staged = sink.stage(key, 15, recs, vectors, consumed=5)
    assert sink.publish(staged)
    assert not staged.tmp_path.exists()
    assert staged.final_path == vectors_dir(tmp_path) / key.filename
    [segment] = iter_segments(tmp_path)
    info = read_info(segment)
    assert (info.first, info.last, info.rows, info.records) == (10, 15, 4, 5)
    assert info.dead_lettered == 1
    assert covered_through([segment]) == 15
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


def test_publish_is_create_if_absent_so_only_one_writer_wins(
    sink: ParquetSink, tmp_path: Path
) -> None:
    # Two writers both believe they own the partition and publish from offset 10:
    # the first wins, the second learns it lost and the first file is untouched.
    winner = stage(sink, "t", 0, 10, 12, [10, 11, 12])
    loser = stage(sink, "t", 0, 10, 19, list(range(10, 20)))
    assert sink.publish(winner)
    before = winner.final_path.read_bytes()
    assert not sink.publish(loser)
    assert not loser.tmp_path.exists()
    assert winner.final_path.read_bytes() == before
    [segment] = iter_segments(tmp_path)
    assert read_info(segment).last == 12


def test_publish_of_a_temp_file_removed_meanwhile_is_a_lost_race(sink: ParquetSink) -> None:
    staged = stage(sink, "t", 0, 0, 0, [0])
    staged.tmp_path.unlink()  # removed as stale while its writer was stopped
    assert not sink.publish(staged)
    assert not staged.final_path.exists()


def test_preload_writes_nothing_in_the_output_and_survives_an_unwritable_temp_dir(
    sink: ParquetSink, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = sorted(p.name for p in tmp_path.rglob("*"))
    sink.preload()
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    monkeypatch.setenv("TMPDIR", str(tmp_path / "missing"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    sink.preload()  # no error: start-up goes on, the preload only saves later page-ins


@pytest.mark.parametrize("upsert", [False, True])
@pytest.mark.parametrize("rows", [parquet_mod.PLAIN, parquet_mod.FLAGGED, parquet_mod.CHUNKED])
def test_the_preload_row_fits_every_modes_columns(upsert: bool, rows: str) -> None:
    """The preload is best effort, so a row its columns refuse would only be logged at
    debug level, and the first batch would pay pyarrow's first write instead."""
    columns = parquet_mod.schema(8, upsert=upsert, rows=rows)
    row = parquet_mod.placeholder_row(columns)
    assert row.num_rows == 1 and row.schema == columns


def test_preload_is_not_skipped(sink: ParquetSink, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG", logger="sinks.parquet")
    sink.preload()
    assert "preload skipped" not in caplog.text


def test_schema_types_per_contract(sink: ParquetSink) -> None:
    staged = stage(sink, "t", 0, 0, 1, [0, 1])
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
    staged = stage(sink, "t", 0, 0, 0, [0])
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
    staged = sink.stage(
        SegmentKey("t", 0, 5), 9, [], np.empty((0, DIM), dtype=np.float32), consumed=5
    )
    sink.publish(staged)
    assert staged.rows == 0
    table = pq.read_table(staged.final_path)
    assert table.num_rows == 0
    assert table.schema.field("embedding").type.list_size == DIM
    assert covered_through(segments_by_partition(tmp_path)[("t", 0)]) == 9


def test_discard_removes_the_temp_file(sink: ParquetSink, tmp_path: Path) -> None:
    staged = stage(sink, "t", 0, 0, 0, [0])
    sink.discard(staged)
    assert not staged.tmp_path.exists()
    assert [p.name for p in vectors_dir(tmp_path).iterdir()] == [writers.WRITERS_DIR]


# ------------------------------------------------------------------ coverage and damage


def test_covered_through_reads_only_the_last_footer_and_takes_legacy_names(
    sink: ParquetSink, tmp_path: Path
) -> None:
    for first, last in [(0, 9), (10, 24)]:
        sink.publish(stage(sink, "t", 0, first, last, list(range(first, last + 1))))
    segments = segments_by_partition(tmp_path)[("t", 0)]
    assert covered_through(segments) == 24
    # A legacy file (name carries its last offset) that runs further counts too.
    legacy = vectors_dir(tmp_path) / "t-p00000-00000000000000000020-00000000000000000030.parquet"
    legacy.write_bytes(b"not even parquet: its name is enough")
    assert covered_through(segments_by_partition(tmp_path)[("t", 0)]) == 30
    assert covered_through([]) is None


def test_a_truncated_segment_is_damaged_and_moves_to_quarantine_with_a_note(
    sink: ParquetSink, tmp_path: Path
) -> None:
    sink.publish(stage(sink, "t", 0, 0, 9, list(range(10))))
    staged = stage(sink, "t", 0, 10, 19, list(range(10, 20)))
    sink.publish(staged)
    data = staged.final_path.read_bytes()
    staged.final_path.write_bytes(data[: len(data) // 2])  # a valid name, half a file
    segments = segments_by_partition(tmp_path)[("t", 0)]
    with pytest.raises(DamagedSegment) as caught:
        covered_through(segments)
    note = quarantine(tmp_path, caught.value.segment, caught.value.reason)
    assert note is not None and (note.first, note.partition) == (10, 0)
    assert not staged.final_path.exists()
    assert (quarantine_dir(tmp_path) / note.file).exists()
    assert [n.first for n in pending_notes(tmp_path)] == [10]
    assert covered_through(segments_by_partition(tmp_path)[("t", 0)]) == 9
    # A second worker that finds the same file gone does nothing.
    assert quarantine(tmp_path, caught.value.segment, "again") is None


# ------------------------------------------------------------------ temp-file hygiene


def _tmp_name(host: str, pid: int, token: str = "deadbeef") -> str:
    return f".{SegmentKey('t', 0, 0).filename}.{host}.{pid}.{token}.tmp"


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_remove_stale_temp_files_only_removes_dead_writers(tmp_path: Path) -> None:
    host = writers.HOST
    live = subprocess.Popen(["sleep", "60"])
    try:
        dead_file = tmp_path / _tmp_name(host, _dead_pid())
        live_file = tmp_path / _tmp_name(host, live.pid)
        remote_file = tmp_path / _tmp_name("some_other_host", _dead_pid())
        segment = tmp_path / SegmentKey("t", 0, 0).filename
        for path in (dead_file, live_file, remote_file, segment):
            path.write_bytes(b"x")
        assert remove_stale_temp_files(tmp_path) == 1
        assert not dead_file.exists()
        assert live_file.exists()
        assert remote_file.exists()  # another machine's writer: young, so maybe alive
        assert segment.exists()  # finished files are never touched
        # Old enough, any temp file is garbage, whatever host or process named it.
        old = time.time() - writers.STALE_TEMP_AGE_S - 60
        for path in (live_file, remote_file, segment):
            os.utime(path, (old, old))
        assert remove_stale_temp_files(tmp_path) == 2
        assert not live_file.exists() and not remote_file.exists()
        assert segment.exists()
    finally:
        live.kill()
        live.wait()


def test_remove_stale_temp_files_same_pid_earlier_process(tmp_path: Path) -> None:
    # Same host and pid as us but another token: an earlier process (pid reuse).
    earlier = tmp_path / _tmp_name(writers.HOST, os.getpid(), "00000000")
    earlier.write_bytes(b"x")
    assert remove_stale_temp_files(tmp_path) == 1
    assert not earlier.exists()


def test_prepare_keeps_this_process_staged_file(sink: ParquetSink, tmp_path: Path) -> None:
    staged = stage(sink, "t", 0, 0, 0, [0])
    assert ParquetSink(tmp_path, MODEL).prepare() == 0
    assert staged.tmp_path.exists()


def test_prepare_removes_dead_writer_files_and_reports_count(tmp_path: Path) -> None:
    directory = vectors_dir(tmp_path)
    directory.mkdir()
    (directory / _tmp_name(writers.HOST, _dead_pid())).write_bytes(b"x")
    assert ParquetSink(tmp_path, MODEL).prepare() == 1
    assert [p.name for p in directory.iterdir()] == [writers.WRITERS_DIR]


_WRITER_ELSEWHERE = """
import sys, time
from pathlib import Path
from sinks import writers
writers.WRITER = "container_4f2a.1.{token}"  # another container: another host name, pid 1
directory = Path(sys.argv[1])
writers.hold_writer_lock(directory)
name = ".t-p00000-00000000000000000000.parquet.0.container_4f2a.1.{token}.tmp"
(directory / name).write_bytes(b"x")
print("ready", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _writer_elsewhere(directory: Path, token: str, lives_s: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER_ELSEWHERE.format(token=token), str(directory), str(lives_s)],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_dead_writers_temp_file_goes_whatever_host_wrote_it(tmp_path: Path) -> None:
    # Containers sharing a volume change host names and all run as pid 1: the
    # writer's lock, not its name, says whether it still lives.
    live = _writer_elsewhere(tmp_path, "aaaa", 60)
    dead = _writer_elsewhere(tmp_path, "bbbb", 0)
    try:
        dead.kill()  # SIGKILL: no clean-up of its own
        dead.wait()
        assert remove_stale_temp_files(tmp_path) == 1
        names = sorted(p.name for p in tmp_path.glob(".*.tmp"))
        assert names == [".t-p00000-00000000000000000000.parquet.0.container_4f2a.1.aaaa.tmp"]
        locks = sorted(p.name for p in (tmp_path / writers.WRITERS_DIR).iterdir())
        assert locks == ["container_4f2a.1.aaaa.lock"]  # the dead writer's lock is gone too
    finally:
        live.kill()
        live.wait()
    assert remove_stale_temp_files(tmp_path) == 1


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
        stage(sink, "t", 0, 0, 0, [0])
    assert [p.name for p in vectors_dir(tmp_path).iterdir()] == [writers.WRITERS_DIR]


def test_publish_failure_raises_output_error(
    sink: ParquetSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    staged = stage(sink, "t", 0, 0, 0, [0])

    def io_error(*_args: object) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(parquet_mod.os, "link", io_error)
    with pytest.raises(OutputError):
        sink.publish(staged)
    assert not staged.final_path.exists()
