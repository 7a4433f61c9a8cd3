"""Compaction: small segments merged into large ones, every row once for readers
listing the directory during and after, ranges and index unchanged, stalled
writers fenced, and crashes at any step leaving a readable dataset."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import OutputError
from pipeline.core.layout import SegmentKey, iter_segments, segments_by_partition, vectors_dir
from sinks import compaction as compaction_mod
from sinks import vectors_swap
from sinks.compact_process import compact_in_child
from sinks.compaction import compact, settle
from sinks.index.check import check_index
from sinks.index.store import IndexStore
from sinks.segments import covered_through, quarantine, read_info
from sinks.vectors_swap import fenced, read_consistently
from tests import helpers
from tests.test_faiss_index import Output

Row = tuple[str, int, int]


def dataset_rows(root: Path) -> list[Row]:
    """What a plain pyarrow.dataset reader of DIR/vectors sees."""
    table = ds.dataset(vectors_dir(root), format="parquet").to_table(
        columns=["topic", "partition", "offset"]
    )
    return list(zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True))


def all_columns(root: Path) -> dict[Row, tuple]:
    table = ds.dataset(vectors_dir(root), format="parquet").to_table()
    rows = {}
    for r in table.to_pylist():
        rows[(r["topic"], r["partition"], r["offset"])] = (r["text"], tuple(r["embedding"]))
    return rows


@pytest.fixture
def out(tmp_path: Path) -> Output:
    return Output(tmp_path)


def fill(out: Output, partitions: int = 2, segments: int = 30, rows: int = 5) -> None:
    for p in range(partitions):
        for n in range(segments):
            first = n * rows
            out.segment("t", p, first, first + rows - 1, skip=(first + 1,) if n % 7 == 0 else ())


def test_compaction_keeps_every_row_once_and_every_column(out: Output) -> None:
    fill(out)
    out.segment("t", 0, 150, 152, skip=(150, 151, 152))  # only bad records: no rows
    before = all_columns(out.root)
    ends = {k: covered_through(v) for k, v in segments_by_partition(out.root).items()}
    report = compact(out.root)
    assert report.files_before == 61 and report.files_after == 2
    assert Counter(dataset_rows(out.root)) == Counter(before.keys())
    assert all(n == 1 for n in Counter(dataset_rows(out.root)).values())
    assert all_columns(out.root) == before
    # where each partition ends (where a restarted worker starts) is unchanged
    assert {k: covered_through(v) for k, v in segments_by_partition(out.root).items()} == ends
    merged = read_info(segments_by_partition(out.root)[("t", 0)][0])
    assert (merged.first, merged.last, merged.rows) == (0, 152, len(before) // 2)
    assert merged.records == 153  # consumed records, dead letters included
    assert compact(out.root).runs == 0  # nothing left to merge


def test_compaction_leaves_the_index_valid_and_unchanged(out: Output) -> None:
    fill(out, segments=10)
    store = IndexStore(out.root)
    store.sync()
    ids = sorted(store.ids().tolist())
    compact(out.root)
    assert store.sync() == 0
    assert sorted(store.ids().tolist()) == ids
    report = check_index(out.root)
    assert report.ok and report.vectors == len(ids)
    out.segment("t", 0, 50, 54)  # the partition goes on after the merged range
    assert store.sync() == 5
    assert check_index(out.root).ok


def test_runs_break_at_gaps_large_files_and_other_models(out: Output) -> None:
    for n in range(4):
        out.segment("t", 0, n * 5, n * 5 + 4)
    for n in range(5, 8):  # offsets 20..24 never written: a gap
        out.segment("t", 0, n * 5, n * 5 + 4)
    other = Output(out.root, dim=8)  # another model's vectors (a mistake, kept apart)
    other.segment("t", 1, 0, 4)
    other.segment("t", 1, 5, 9)
    out.segment("t", 1, 10, 14)
    compaction_mod.compact(out.root)
    names = sorted(s.path.name for s in iter_segments(out.root))
    assert names == [
        "t-p00000-00000000000000000000-00000000000000000019.parquet",
        "t-p00000-00000000000000000025-00000000000000000039.parquet",
        "t-p00001-00000000000000000000-00000000000000000009.parquet",
        "t-p00001-00000000000000000010.parquet",
    ]
    small_target = compact(out.root, target_bytes=1).runs
    assert small_target == 0


def test_a_stalled_writer_cannot_publish_inside_a_merged_range(out: Output) -> None:
    for n in range(4):
        out.segment("t", 0, n * 5, n * 5 + 4)
    # A writer staged offsets 10..14 and stalled; the partition moved on and was compacted.
    stale = out._stage("t", 0, 10, 14, ())
    (vectors_dir(out.root) / SegmentKey("t", 0, 10).filename).unlink(missing_ok=True)
    out.segment("t", 0, 10, 14)
    rows_before = Counter(dataset_rows(out.root))
    compact(out.root)
    assert not (vectors_dir(out.root) / SegmentKey("t", 0, 10).filename).exists()
    assert out.sink.publish(stale) is False  # the name is free, the fence holds
    assert Counter(dataset_rows(out.root)) == rows_before
    # a quarantined merged file releases its fence: its range is written again
    merged = segments_by_partition(out.root)[("t", 0)][0]
    quarantine(out.root, merged, "test")
    assert not fenced(vectors_dir(out.root), SegmentKey("t", 0, 10))


def test_readers_and_writers_during_compactions_see_every_row_once(out: Output) -> None:
    fill(out, partitions=1, segments=20)
    written: list[Row] = list(dataset_rows(out.root))
    lock = threading.Lock()
    stop = threading.Event()
    seen: list[int] = []
    errors: list[str] = []

    def writer() -> None:
        first = 100
        while not stop.is_set():
            out.segment("t", 0, first, first + 4)
            with lock:
                written.extend(("t", 0, o) for o in range(first, first + 5))
            first += 5
            # Unthrottled, a loaded host's rounds each met thousands more files than
            # the last and the test ran for minutes.
            stop.wait(0.002)

    def reader() -> None:
        plain = False
        while not stop.is_set():
            with lock:
                floor = set(written)
            plain = not plain
            started = time.monotonic()
            try:
                if plain:  # a reader knowing nothing of us: may fail, never be wrong
                    rows = dataset_rows(out.root)
                else:
                    rows = read_consistently(out.root, lambda: dataset_rows(out.root))
            except FileNotFoundError:
                if not plain:
                    errors.append("read_consistently failed")
                continue
            # What plain readers are promised: a listing that takes under the grace
            # (a whole read that did cannot have listed longer). One descheduled for
            # longer may lose the entries removed under it, as documented.
            promised = not plain or time.monotonic() - started < compaction_mod.RETIRED_GRACE_S
            counts = Counter(rows)
            reader = "plain" if plain else "read_consistently"
            if any(n > 1 for n in counts.values()):
                errors.append(f"{reader}: doubled rows")
            if not floor <= set(counts) and promised:
                errors.append(f"{reader}: missing {len(floor - set(counts))} rows")
            seen.append(len(rows))

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    try:
        # At least 8 rounds, and more while the reader has checked too few reads
        # (on a loaded host its thread may be starved through the first eight).
        rounds, deadline = 0, time.monotonic() + 120
        while rounds < 8 or (len(seen) < 4 and time.monotonic() < deadline):
            compact(out.root)
            rounds += 1
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    compact(out.root)
    final = Counter(dataset_rows(out.root))  # first: rows lost for good, or only for a reader
    assert all(n == 1 for n in final.values())
    assert set(final) == set(written)
    assert errors == []
    assert len(seen) > 3


def test_a_reader_listing_during_an_exchange_still_finds_every_file(out: Output) -> None:
    """A plain reader part-way through listing vectors/ when a compaction swaps it
    aside lists the old directory to the end: removed at once, its entries would go
    from under the listing, and the files it then opens by name, in the new
    directory, would miss rows without any error."""
    for k in range(1500):
        out.segment("t", 0, 3 * k, 3 * k + 1)  # a gap after each: never merged
    for k in range(4):
        out.segment("t", 1, 2 * k, 2 * k + 1)  # merged by the compaction
    never_merged = {s.path.name for s in iter_segments(out.root) if s.key.partition == 0}
    with os.scandir(vectors_dir(out.root)) as listing:
        listed = [next(listing).name]  # the reader's first entries ...
        report = compact(out.root)  # ... when the exchange happens
        listed += [entry.name for entry in listing]
    assert report.merged_files == 4
    assert never_merged <= set(listed)
    retired = [p for p in out.root.iterdir() if p.name.startswith(".vectors.retired-")]
    assert len(retired) == 1  # kept aside a while ...
    settle(out.root)  # ... `pipeline compact` waits for that, then removes it
    assert not [p for p in out.root.iterdir() if p.name.startswith(".vectors.retired-")]


def test_a_segment_listing_across_an_exchange_is_taken_again(
    out: Output, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a partition's output ends (a worker's start) is never read from a listing
    an exchange cut short."""
    fill(out, partitions=1, segments=6)
    real_listdir = os.listdir
    cut_short: list[str] = []

    def listing_then_exchange(path: os.PathLike[str] | str = ".") -> list[str]:
        names = real_listdir(path)
        if not cut_short and Path(path) == vectors_dir(out.root):
            cut_short.extend(names[: len(names) // 2])  # entries removed under the listing
            compact(out.root)  # ... as a compaction swapped the directory out
            return cut_short
        return names

    monkeypatch.setattr(os, "listdir", listing_then_exchange)
    listed = [s.path.name for s in iter_segments(out.root)]
    monkeypatch.undo()
    assert cut_short and listed == [s.path.name for s in iter_segments(out.root)]
    assert len(listed) == 1  # the merged file, from a listing of the new directory


def test_an_exchange_is_seen_by_its_token_not_only_the_inode(
    out: Output, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill(out, partitions=1, segments=6)
    before = vectors_swap._identity(out.root)
    compact(out.root)
    after = vectors_swap._identity(out.root)
    assert before is not None and after is not None
    assert before[2] is None and after[2] is not None and before != after
    # An inode number reused by the next vectors/ (ext4 reuses freed ones): the token
    # still tells them apart, so read_consistently reads again.
    reads = iter([(*before[:2], "one"), (*before[:2], "other"), after, after])
    monkeypatch.setattr(vectors_swap, "_identity", lambda _output: next(reads))
    calls = []
    assert read_consistently(out.root, lambda: calls.append(1) or len(calls)) == 2


class Crash(BaseException):
    """The process dying at this point: no clean-up runs."""


@pytest.mark.parametrize("step", ["exchange", "cleanup"])
def test_a_crash_at_any_step_leaves_a_readable_dataset(
    out: Output, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    fill(out, partitions=1, segments=12)
    before = Counter(dataset_rows(out.root))

    def die(*_args: object, **_kwargs: object) -> None:
        raise Crash

    with monkeypatch.context() as m:
        if step == "exchange":
            m.setattr(compaction_mod, "exchange", die)
        else:
            real = compaction_mod.exchange

            def exchange_then_die(a: Path, b: Path) -> None:
                real(a, b)
                raise Crash

            m.setattr(compaction_mod, "exchange", exchange_then_die)
        m.setattr(compaction_mod.shutil, "rmtree", die)
        with pytest.raises(Crash):
            compact(out.root)
    assert Counter(dataset_rows(out.root)) == before  # old set or new set, each row once
    for segment in iter_segments(out.root):
        pq.read_table(segment.path)  # every file readable on its own
    leftovers = [p for p in out.root.iterdir() if p.name.startswith(".compact-")]
    assert leftovers  # what the crash left behind ...
    compact(out.root)
    assert not [p for p in out.root.iterdir() if p.name.startswith((".compact-", ".vectors.next"))]
    assert Counter(dataset_rows(out.root)) == before  # ... the next run cleans up
    assert len(list(iter_segments(out.root))) == 1


def test_merged_files_are_read_fast_by_plain_readers(out: Output) -> None:
    fill(out, partitions=1, segments=40, rows=3)
    compact(out.root)
    (segment,) = iter_segments(out.root)
    metadata = pq.read_metadata(segment.path)
    assert metadata.num_row_groups == 1
    vectors = np.stack(pq.read_table(segment.path).column("embedding").to_numpy(False))
    assert vectors.shape[1] == out.dim


# ------------------------------------------------------------------ workers compacting


def test_workers_compacting_as_they_run_keep_every_offset_once(
    broker, make_topic, group_id, tmp_path, tiny_model
):
    topic = make_topic(partitions=2)
    helpers.publish_json(broker, topic, helpers.corpus_records(1600), partitions=2)
    out = tmp_path / "out"
    common = (
        "--model",
        tiny_model,
        "--batch-size",
        "8",
        "--poll-timeout-ms",
        "50",
        "--session-timeout-ms",
        "6000",
        "--index-sync-interval-s",
        "1",
        "--compact-interval-s",
        "0.5",
    )
    a = helpers.start_worker(broker, topic, group_id, out, *common, log=tmp_path / "a.log")
    b = helpers.start_worker(broker, topic, group_id, out, *common, log=tmp_path / "b.log")

    def rows_now() -> list[Row]:  # while workers compact: read again across an exchange
        return read_consistently(out, lambda: helpers.output_rows(out))

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(rows_now()) < 600:
        time.sleep(0.5)
    b.send_signal(signal.SIGKILL)  # mid-run, maybe mid-compaction: a crash leaves debris
    b.wait(timeout=30)
    assert helpers.duplicates(rows_now()) == []
    a.send_signal(signal.SIGTERM)
    assert a.wait(timeout=120) == 0

    result = helpers.run_until_end(broker, topic, group_id, out, *common, timeout=300)

    assert result.returncode == 0, result.stderr
    rows = helpers.output_rows(out)
    assert helpers.duplicates(rows) == []
    assert set(rows) == {(topic, p, o) for p in (0, 1) for o in range(800)}
    assert sorted(helpers.index_rows(out)) == sorted(rows)
    assert helpers.committed_offsets(broker, group_id, topic) == {0: 800, 1: 800}
    ranged = [s for s in iter_segments(out) if s.named_last is not None]
    assert ranged, "no compaction happened while the workers ran"
    assert len(list(iter_segments(out))) < 1600 // 8 / 2
    assert check_index(out).ok


def test_a_worker_compacts_in_a_child_process_that_stops_when_asked(out: Output) -> None:
    fill(out, segments=200, rows=50)
    before = all_columns(out.root)
    stopped = threading.Event()
    stopped.set()  # asked to stop at once: nothing changes, nothing is left behind
    assert compact_in_child(out.root, 128 << 20, stopped) is None
    assert all_columns(out.root) == before
    assert len(list(iter_segments(out.root))) == 400
    report = compact_in_child(out.root, 128 << 20, threading.Event())
    assert report is not None and (report.runs, report.merged_files) == (2, 400)
    assert all_columns(out.root) == before
    assert sorted(p.name for p in out.root.iterdir() if p.name.startswith(".compact-")) == []
    assert not any(p.name.startswith(".vectors.next-") for p in out.root.iterdir())


def test_a_failed_compaction_child_reports_its_one_line_reason(tmp_path: Path) -> None:
    with pytest.raises(OutputError) as failed:
        compact_in_child(tmp_path / "missing", 128 << 20, threading.Event())
    assert "cannot use" in str(failed.value) and "\n" not in str(failed.value)
