"""The check, independent of the workers: every committed record in exactly one row
or dead letter, none invented, the index holding every row once, the commits at
the end; and `pipeline audit`'s own verdict to compare."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.common import PYTHON, REPO, HarnessError, ranges
from chaos.records import Published, is_bad, value_text


def read_topic(bootstrap: str, topic: str, timeout_s: float = 120) -> list[Any]:
    """Every committed record of a topic (read_committed, no group), beginning to end."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        isolation_level="read_committed",
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=4 * 1024 * 1024,
    )
    try:
        numbers = consumer.partitions_for_topic(topic)
        if not numbers:
            return []
        partitions = [TopicPartition(topic, p) for p in sorted(numbers)]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        ends = consumer.end_offsets(partitions)
        records: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < end for tp, end in ends.items()):
            if time.monotonic() > deadline:
                raise HarnessError(f"reading {topic} did not reach its end offsets {ends}")
            for batch in consumer.poll(timeout_ms=500).values():
                records += batch
        return records
    finally:
        consumer.close()


def topic_exists(bootstrap: str, topic: str) -> bool:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    try:
        return topic in consumer.topics()
    finally:
        consumer.close()


def group_committed(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int]:
    """The group's committed offsets (read without joining the group)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        found = {p: consumer.committed(TopicPartition(topic, p)) for p in range(partitions)}
    finally:
        consumer.close(autocommit=False)
    return {p: offset for p, offset in found.items() if offset is not None and offset >= 0}


class ChunkedText(str):
    """A chunked record's rows (`pipeline run --chunk-tokens N`) as one row of the scan.

    Its value is its chunks' texts joined, in chunk order (for display); compared with
    a record's text it is equal when its chunks are complete (0..chunk_count-1, once
    each) and each is the text's [char_start:char_end], with nothing but whitespace
    outside them (past the last one, anything when it says the text was truncated)."""

    spans: tuple[tuple[int, int, int, int, str, bool], ...]  # chunk, count, start, end,
    # text, truncated

    def __new__(cls, spans: Iterable[tuple[int, int, int, int, str, bool]]) -> ChunkedText:
        ordered = tuple(sorted(spans))
        made = super().__new__(cls, "".join(span[4] for span in ordered))
        made.spans = ordered
        return made

    @property
    def chunks(self) -> list[int]:
        return [span[0] for span in self.spans]

    @property
    def complete(self) -> bool:
        counts = {span[1] for span in self.spans}
        return len(counts) == 1 and self.chunks == list(range(counts.pop()))

    def matches(self, text: str | None) -> bool:
        if text is None or not self.complete:
            return False
        covered = 0
        for _, _, start, end, chunk_text, _ in self.spans:
            if text[start:end] != chunk_text or text[covered:start].strip():
                return False
            covered = max(covered, end)
        return self.spans[-1][5] or not text[covered:].strip()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str) and not isinstance(other, ChunkedText):
            return self.matches(other)
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = str.__hash__


def row_ids(partition: int, offset: int, text: str) -> list[tuple[int, ...]]:
    """The index ids a scan row stands for: (partition, offset), or in a chunked output
    (partition, offset, chunk) for each of its chunks (index_entries keys them so)."""
    if isinstance(text, ChunkedText):
        return [(partition, offset, chunk) for chunk in text.chunks]
    return [(partition, offset)]


@dataclass
class RowScan:
    """What the Parquet files under DIR/vectors hold, read with pyarrow alone."""

    # partition, offset, text: a row per record (a chunked record's rows in one, its
    # text a ChunkedText)
    rows: list[tuple[int, int, str]] = field(default_factory=list)
    other_topics: int = 0  # rows naming another topic than the seed's
    bad_vectors: int = 0  # not finite, or not of unit length (the tiny model normalises)
    files: int = 0
    unreadable: list[str] = field(default_factory=list)  # damaged segments left in place
    # Upsert mode's columns, row by row as in `rows`: (doc_key, deleted); empty otherwise.
    documents: list[tuple[str | None, bool]] = field(default_factory=list)
    # Offsets a purge erased (upsert mode), from the footers' segment.purged.
    purged: list[tuple[int, int]] = field(default_factory=list)


_SEGMENT_NAME = re.compile(r"^(?P<topic>.+)-p(?P<partition>\d{5})-\d{20}(?:-\d{20})?\.parquet$")
_PURGED_KEY = b"segment.purged"  # sinks.segments.PURGED_KEY: [[first, last], ...]
_UPSERT_COLUMNS = ("doc_key", "deleted")
# A chunked output's (pipeline.core.chunks): a record is a row per chunk.
_CHUNK_COLUMNS = ("chunk", "chunk_count", "char_start", "char_end", "truncated")


def parquet_rows(output: Path, topic: str) -> RowScan:
    import numpy as np
    import pyarrow.parquet as pq

    scan = RowScan()
    columns = ["topic", "partition", "offset", "text", "embedding"]
    for path in sorted((output / "vectors").glob("*.parquet")):
        scan.files += 1
        try:
            schema = pq.read_schema(path)
            extra = [c for c in _UPSERT_COLUMNS if c in schema.names]
            spans = [c for c in _CHUNK_COLUMNS if c in schema.names]
            table = pq.read_table(path, columns=columns + extra + spans)
        except (OSError, ValueError) as exc:  # pyarrow's errors: its rows count as absent
            scan.unreadable.append(f"{path.name}: {exc}")
            continue
        _purged(scan, path, schema.metadata or {}, topic)
        if table.num_rows == 0:
            continue
        mine = [t == topic for t in table["topic"].to_pylist()]
        scan.other_topics += mine.count(False)
        rows = list(
            zip(
                table["partition"].to_pylist(),
                table["offset"].to_pylist(),
                table["text"].to_pylist(),
                strict=True,
            )
        )
        deleted = np.zeros(table.num_rows, dtype=bool)
        documents: list[tuple[str | None, bool]] = []
        if extra:
            keys = table["doc_key"].to_pylist() if "doc_key" in extra else [None] * len(mine)
            flags = table["deleted"].to_pylist() if "deleted" in extra else [False] * len(mine)
            deleted = np.array([bool(f) for f in flags], dtype=bool)
            documents = [(k, bool(f)) for k, f in zip(keys, flags, strict=True)]
        if "chunk" in spans:  # a record per row: the seed's topic's only
            rows, documents = _records(table, rows, documents, spans, topic)
            mine = [True] * len(rows)
        scan.rows += [row for row, ok in zip(rows, mine, strict=True) if ok]
        scan.documents += [d for d, ok in zip(documents, mine, strict=False) if ok]
        flat = table["embedding"].combine_chunks().flatten().to_numpy(zero_copy_only=False)
        vectors = flat.reshape(table.num_rows, -1)
        norms = np.linalg.norm(vectors, axis=1)
        bad = ~np.isfinite(norms) | (np.abs(norms - 1) > 1e-3)
        # A tombstone's row (upsert mode) holds a zero vector: that, and only that, is right.
        bad[deleted] = norms[deleted] != 0
        scan.bad_vectors += int(bad.sum())
    return scan


def _records(
    table: Any,
    rows: list[tuple[int, int, str]],
    documents: list[tuple[str | None, bool]],
    spans: list[str],
    topic: str,
) -> tuple[list[tuple[int, int, str]], list[tuple[str | None, bool]]]:
    """A chunked segment's rows of `topic` as one row per record (in the order of their
    first rows), its text a ChunkedText; and one document entry per record."""
    columns = {name: table[name].to_pylist() for name in spans}
    absent = [None] * len(rows)
    topics = table["topic"].to_pylist()
    grouped: dict[tuple[int, int], list[int]] = {}
    for n, (partition, offset, _) in enumerate(rows):
        if topics[n] == topic:
            grouped.setdefault((partition, offset), []).append(n)
    records, docs = [], []
    for (partition, offset), indices in grouped.items():
        text = ChunkedText(
            (
                _int(columns["chunk"][n]),
                _int(columns.get("chunk_count", absent)[n]),
                _int(columns.get("char_start", absent)[n]),
                _int(columns.get("char_end", absent)[n]),
                rows[n][2],
                bool(columns.get("truncated", absent)[n]),
            )
            for n in indices
        )
        records.append((partition, offset, text))
        if documents:
            docs.append(documents[indices[0]])
    return records, docs


def _int(value: Any) -> int:
    return -1 if value is None else int(value)


def _purged(scan: RowScan, path: Path, metadata: dict[bytes, bytes], topic: str) -> None:
    text, name = metadata.get(_PURGED_KEY), _SEGMENT_NAME.match(path.name)
    if not text or name is None or name["topic"] != topic:
        return
    partition = int(name["partition"])
    for first, last in json.loads(text):
        scan.purged += [(partition, offset) for offset in range(int(first), int(last) + 1)]


def dead_letters(records: Iterable[Any], topic: str) -> Counter[tuple[int, int]]:
    found: Counter[tuple[int, int]] = Counter()
    for record in records:
        headers = {k: v.decode("utf-8", "replace") for k, v in (record.headers or [])}
        if headers.get("source.topic") != topic:
            continue
        found[(int(headers["source.partition"]), int(headers["source.offset"]))] += 1
    return found


def index_entries(output: Path, topic: str) -> Counter[tuple[int, ...]] | None:
    """(partition, offset) of each FAISS index entry, (partition, offset, chunk) in an
    index of chunks; None when there is no index."""
    from sinks.index.store import IndexStore

    if not (output / "index").is_dir():
        return None
    store = IndexStore(output)
    store.load()
    if store.meta is None:
        return None
    numbers = {no: name for name, no in store.meta.topics.items()}
    decode = id_decoder(store.meta)
    entries: Counter[tuple[int, ...]] = Counter()
    for vector_id in store.ids():
        topic_no, *place = decode(int(vector_id))
        if numbers.get(topic_no) == topic:
            entries[tuple(place)] += 1
    return entries


def id_decoder(meta: Any) -> Any:
    """An index id as (topic_no, partition, offset), or (topic_no, partition, offset,
    chunk) where the index's ids are of chunks (sinks.index.shards.IdLayout)."""
    from sinks.index.shards import decode_id

    layout = getattr(meta, "layout", None)
    if layout is not None and getattr(layout, "chunked", False):
        return layout.decode
    return decode_id


# ---------------------------------------------------------------------------- the check


@dataclass
class Verdict:
    records: int = 0
    bad_records: int = 0
    rows: int = 0
    dead_letters: int = 0
    lost: list[tuple[int, int]] = field(default_factory=list)
    doubled: list[tuple[int, int]] = field(default_factory=list)
    phantom: list[tuple[int, int]] = field(default_factory=list)
    misrouted: list[tuple[int, int]] = field(default_factory=list)  # good dead-lettered, bad rows
    mismatched: list[tuple[int, int]] = field(default_factory=list)  # row text != record text
    dead_letter_repeats: int = 0  # a bad record in the dead-letter topic more than once
    other_topics: int = 0  # rows naming another topic
    bad_vectors: int = 0  # embeddings not finite or not unit length
    unreadable: list[str] = field(default_factory=list)  # damaged segments still in vectors/
    index: dict[str, int] = field(default_factory=dict)
    commits_short: dict[int, str] = field(default_factory=dict)
    reader_suspect: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (
            self.lost
            or self.doubled
            or self.phantom
            or self.misrouted
            or self.mismatched
            or self.dead_letter_repeats
            or any(self.index.values())
            or self.commits_short
            or self.other_topics
            or self.bad_vectors
            or self.unreadable
        )

    def problems(self) -> list[str]:
        found = []
        for name in ("lost", "doubled", "phantom", "misrouted", "mismatched"):
            keys = getattr(self, name)
            if keys:
                found.append(f"{name} {len(keys)}: {ranges(keys)}")
        if self.dead_letter_repeats:
            found.append(f"dead letters sent more than once: {self.dead_letter_repeats}")
        found += [f"index {k} {v}" for k, v in self.index.items() if v]
        if self.commits_short:
            found.append(f"commits short of the end: {self.commits_short}")
        if self.other_topics:
            found.append(f"rows naming another topic: {self.other_topics}")
        if self.bad_vectors:
            found.append(f"embeddings not finite or not of unit length: {self.bad_vectors}")
        found += [f"unreadable segment left in vectors/: {u[:300]}" for u in self.unreadable]
        return found + [f"reader: {s}" for s in self.reader_suspect]


def check_records(
    real: dict[tuple[int, int], bytes | None],
    rows: list[tuple[int, int, str]],
    dlq: Counter[tuple[int, int]],
) -> Verdict:
    """Every real record in exactly one row, or (bad records) in the dead-letter topic."""
    verdict = Verdict(records=len(real), rows=len(rows), dead_letters=sum(dlq.values()))
    row_count: Counter[tuple[int, int]] = Counter((p, o) for p, o, _ in rows)
    row_text = {(p, o): t for p, o, t in rows}  # a chunked record's: its ChunkedText
    for key, value in sorted(real.items()):
        bad = is_bad(value)
        verdict.bad_records += bad
        in_rows, in_dlq = row_count[key], dlq[key]
        if not in_rows and not in_dlq:
            verdict.lost.append(key)
        elif in_rows > 1 or (in_rows and in_dlq):
            verdict.doubled.append(key)
        elif (bad and in_rows) or (not bad and in_dlq):
            verdict.misrouted.append(key)
        elif in_rows and row_text[key] != value_text(value):
            verdict.mismatched.append(key)
        if bad and in_dlq > 1 and not in_rows:
            verdict.dead_letter_repeats += in_dlq - 1
    verdict.phantom = sorted((set(row_count) | set(dlq)) - set(real))
    return verdict


def check_index(verdict: Verdict, rows: list[tuple[int, int, str]], index: Counter | None) -> None:
    row_keys = {key for p, o, t in rows for key in row_ids(p, o, t)}
    if index is None:
        verdict.index = {"absent": 1 if row_keys else 0}
        return
    verdict.index = {
        "missing": len(row_keys - set(index)),
        "doubled": sum(1 for n in index.values() if n > 1),
        "extra": len(set(index) - row_keys),
    }


def check_commits(verdict: Verdict, committed: dict[int, int], ends: dict[int, int]) -> None:
    for partition, end in sorted(ends.items()):
        offset = committed.get(partition)
        if offset is None or offset < end:
            verdict.commits_short[partition] = f"committed {offset}, end {end}"


def check_java(verdict: Verdict, real: dict[tuple[int, int], bytes | None], pub: Published) -> None:
    """Cross-checks the read_committed reader with what the Java producer reported."""
    if not pub.java:
        return
    seen: Counter[str] = Counter()
    for value in real.values():
        if value is not None and b'"java-' in value:
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                seen[str(json.loads(value)["id"])] += 1
    if set(seen) != pub.java_committed_ids:
        missing = len(pub.java_committed_ids - set(seen))
        aborted = len(set(seen) & pub.java_aborted_ids)
        verdict.reader_suspect.append(
            f"java committed ids missing from the topic: {missing}, aborted ids read: {aborted}"
        )
    if any(n > 1 for n in seen.values()):
        verdict.reader_suspect.append("a java id appears at two offsets")


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    """End offsets (read_committed) per partition, for the commit check."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed")
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or []]
        return {tp.partition: off for tp, off in consumer.end_offsets(partitions).items()}
    finally:
        consumer.close()


def run_cli(args: list[str], bootstrap: str, timeout_s: float = 180) -> tuple[int, str, str]:
    env = dict(os.environ, PIPELINE_BOOTSTRAP_SERVERS=bootstrap, HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [PYTHON, "-m", "pipeline.cli", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return done.returncode, done.stdout, done.stderr


def has_audit(bootstrap: str) -> bool:
    rc, _, _ = run_cli(["audit", "--help"], bootstrap, timeout_s=60)
    return rc == 0


def run_audit(bootstrap: str, output: Path, group: str, topic: str, clean: bool) -> dict[str, Any]:
    """`pipeline audit --json`, and whether its verdict agrees with the harness's."""
    if not has_audit(bootstrap):
        return {"present": False}
    args = ["audit", "--output", str(output), "--group", group, "--topic", topic, "--json"]
    rc, out, err = run_cli(args, bootstrap)
    result: dict[str, Any] = {"present": True, "rc": rc, "agrees": (rc == 0) == clean}
    if rc not in (0, 1):
        result["agrees"] = False
        result["error"] = (err.strip().splitlines() or [""])[-1]
    try:
        report = json.loads(out)
    except ValueError:
        result["stdout"] = out[-2000:]
        return result
    result["totals"] = report.get("totals")
    result["partitions"] = [
        {k: p.get(k) for k in ("partition", "committed", "end", "missing", "doubled", "ok")}
        for p in report.get("partitions", [])
        if not p.get("ok", True)
    ]
    return result


# ---------------------------------------------------------------------------- one seed
