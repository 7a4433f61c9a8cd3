"""The check of an upsert-mode seed (`--write-mode upsert`), independent of the workers.

From the topic itself (read_committed), with the contract written in
chaos.records.upsert_verdict:

- every committed record in exactly one place: a good record in one segment row
  (its text, its document, not deleted), a tombstone naming a document in one row
  with `deleted=true` and no text (its zero vector is right), a bad record in the
  dead-letter topic; after `pipeline compact --purge`, a superseded version or a
  tombstone's row may instead be in a footer's purged offsets, never a live one;
- the expected live set: per document, the latest of its good records and
  tombstones (the highest offset within its partition; across partitions, which the
  harness's traffic never makes, the later timestamp, then topic, then partition);
  the document is live when that is a good record. DIR/current (read with `lance`)
  must hold exactly those documents, each with that version's text, topic,
  partition and offset: none lost, none extra, none stale, none twice;
- the index: its shard files hold every non-deleted row once and no deleted one;
  what it serves (less its removals) is exactly the live versions;
- after the purge: segment rows are the live versions only (no superseded or
  deleted text left), and `pipeline audit` exits 0.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.check import ChunkedText, RowScan, Verdict, id_decoder, row_ids, run_cli
from chaos.common import ranges
from chaos.records import BAD, DELETE, GOOD, upsert_verdict

Place = tuple[int, int]  # partition, offset


@dataclass(frozen=True)
class Version:
    partition: int
    offset: int
    timestamp: int
    kind: str  # GOOD or DELETE
    text: str  # "" for a tombstone


@dataclass
class Expected:
    """What the topic says the outputs must hold."""

    placement: dict[Place, tuple[str, str | None, str]]  # kind, document, text ("" if none)
    latest: dict[str, Version]  # per document, its latest version (live if GOOD)
    cross_partition: list[str] = field(default_factory=list)  # documents in 2+ partitions
    versions: Counter[str] = field(default_factory=Counter)  # good records per document

    @property
    def live(self) -> dict[str, Version]:
        return {k: v for k, v in self.latest.items() if v.kind == GOOD}

    @property
    def live_places(self) -> set[Place]:
        return {(v.partition, v.offset) for v in self.live.values()}

    def stale_texts(self) -> set[str]:
        """Texts of good records that are not the live version of their document."""
        live = self.live_places
        return {
            text
            for place, (kind, _, text) in self.placement.items()
            if kind == GOOD and place not in live
        }


def _newer(a: Version, b: Version, topic: str) -> bool:
    if a.partition == b.partition:
        return a.offset > b.offset
    return (a.timestamp, topic, a.partition) > (b.timestamp, topic, b.partition)


def expected(records: Iterable[Any], topic: str) -> Expected:
    """The placement of every committed record and the latest version of each document."""
    found = Expected({}, {})
    partitions: dict[str, set[int]] = {}
    for record in records:
        place = (record.partition, record.offset)
        kind, document = upsert_verdict(record.key, record.value)
        text = ""
        if kind == GOOD:
            text = json.loads(record.value.decode("utf-8"))["text"]
            found.versions[str(document)] += 1
        found.placement[place] = (kind, document, text)
        if kind == BAD or document is None:
            continue
        version = Version(record.partition, record.offset, record.timestamp, kind, text)
        partitions.setdefault(document, set()).add(record.partition)
        held = found.latest.get(document)
        if held is None or _newer(version, held, topic):
            found.latest[document] = version
    found.cross_partition = sorted(k for k, seen in partitions.items() if len(seen) > 1)
    return found


@dataclass
class DocumentVerdict:
    """What an upsert-mode seed adds to the per-offset verdict."""

    documents: int = 0  # live documents expected
    deletions: int = 0  # tombstones that name a document
    updated: int = 0  # documents with two or more good versions
    readded: int = 0  # documents with a good version after a tombstone
    view_rows: int = 0
    view_lost: list[str] = field(default_factory=list)
    view_extra: list[str] = field(default_factory=list)
    view_stale: list[str] = field(default_factory=list)
    view_doubled: list[str] = field(default_factory=list)
    view_absent: bool = False
    view_other_topics: int = 0
    wrong_document: list[Place] = field(default_factory=list)  # row's doc_key or flag wrong
    wrongly_purged: list[Place] = field(default_factory=list)  # a live version or bad record
    left_after_purge: list[Place] = field(default_factory=list)  # superseded/deleted rows
    stale_texts_left: int = 0  # rows holding a superseded or deleted version's text
    cross_partition: list[str] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)

    def problems(self) -> list[str]:
        found = []
        if self.view_absent and self.documents:
            found.append(f"view: no DIR/current, {self.documents} live document(s) expected")
        for name in ("view_lost", "view_extra", "view_stale", "view_doubled"):
            keys = getattr(self, name)
            if keys:
                found.append(f"{name.replace('_', ' ')} {len(keys)}: {sorted(keys)[:20]}")
        if self.view_other_topics:
            found.append(f"view rows naming another topic: {self.view_other_topics}")
        for name in ("wrong_document", "wrongly_purged", "left_after_purge"):
            keys = getattr(self, name)
            if keys:
                found.append(f"{name.replace('_', ' ')} {len(keys)}: {ranges(keys)}")
        if self.stale_texts_left:
            found.append(f"rows holding superseded or deleted texts: {self.stale_texts_left}")
        if self.cross_partition:
            found.append(
                f"harness: documents published to 2+ partitions {len(self.cross_partition)}: "
                f"{self.cross_partition[:10]}"
            )
        found += [f"index {k} {v}" for k, v in self.index.items() if v]
        return found

    @property
    def clean(self) -> bool:
        return not self.problems()


def check_records(
    want: Expected, scan: RowScan, dlq: Counter[Place], purged_phase: bool = False
) -> tuple[Verdict, DocumentVerdict]:
    """Every committed record in exactly one place (rows, dead letters, purged offsets),
    the right one; each row naming its record's document, tombstone rows deleted."""
    rows, documents = scan.rows, scan.documents
    verdict = Verdict(records=len(want.placement), rows=len(rows), dead_letters=sum(dlq.values()))
    docs = DocumentVerdict(cross_partition=want.cross_partition)
    row_count: Counter[Place] = Counter((p, o) for p, o, _ in rows)
    row_text = {(p, o): t for p, o, t in rows}
    row_doc = {(p, o): d for (p, o, _), d in zip(rows, documents, strict=False)}
    if len(documents) != len(rows):
        docs.wrong_document += sorted(row_count)  # rows without upsert mode's columns
    purged = Counter(scan.purged)
    live = want.live_places
    for place, (kind, document, text) in sorted(want.placement.items()):
        bad = kind == BAD
        verdict.bad_records += bad
        in_rows, in_dlq, in_purged = row_count[place], dlq[place], purged[place]
        if not in_rows and not in_dlq and not in_purged:
            verdict.lost.append(place)
        elif in_rows + in_purged > 1 or ((in_rows or in_purged) and in_dlq):
            verdict.doubled.append(place)
        elif (bad and (in_rows or in_purged)) or (not bad and in_dlq):
            verdict.misrouted.append(place)
        elif in_rows and row_text[place] != text:
            verdict.mismatched.append(place)
        elif in_rows and place in row_doc and row_doc[place] != (document, kind == DELETE):
            docs.wrong_document.append(place)
        if in_purged and not bad and place in live:
            docs.wrongly_purged.append(place)
        if purged_phase and in_rows and place not in live:
            docs.left_after_purge.append(place)
        if bad and in_dlq > 1 and not in_rows:
            verdict.dead_letter_repeats += in_dlq - 1
    verdict.phantom = sorted((set(row_count) | set(dlq) | set(purged)) - set(want.placement))
    if purged_phase:
        stale = want.stale_texts()
        # A chunked record's text equals a stale one by its chunks, not by its hash.
        docs.stale_texts_left = sum(
            1
            for _, _, t in rows
            if t in stale or (isinstance(t, ChunkedText) and any(t == s for s in stale))
        )
    _count_traffic(want, docs)
    return verdict, docs


def _count_traffic(want: Expected, docs: DocumentVerdict) -> None:
    docs.documents = len(want.live)
    docs.updated = sum(1 for n in want.versions.values() if n > 1)
    history: dict[str, list[tuple[int, str]]] = {}
    for (partition, offset), (kind, document, _) in want.placement.items():
        if kind == DELETE:
            docs.deletions += 1
        if document is not None and kind != BAD:
            history.setdefault(f"{partition}:{document}", []).append((offset, kind))
    for versions in history.values():
        kinds = [kind for _, kind in sorted(versions)]
        if any(a == DELETE and b == GOOD for a, b in itertools.pairwise(kinds)):
            docs.readded += 1


def view_rows(output: Path) -> list[dict[str, Any]] | None:
    """DIR/current's rows (doc_key, text, topic, partition, offset, and a chunked
    view's chunk, chunk_count, char_start, char_end, truncated); None: no view."""
    path = output / "current"
    if not path.is_dir():
        return None
    import lance

    dataset = lance.dataset(str(path))
    columns = ["doc_key", "text", "topic", "partition", "offset"]
    columns += [c for c in _VIEW_CHUNK_COLUMNS if c in dataset.schema.names]
    return dataset.to_table(columns=columns).to_pylist()


_VIEW_CHUNK_COLUMNS = ("chunk", "chunk_count", "char_start", "char_end", "truncated")


def check_view(
    docs: DocumentVerdict, want: Expected, rows: list[dict[str, Any]] | None, topic: str
) -> None:
    """DIR/current against the expected live set: lost, extra, stale, doubled documents."""
    live = want.live
    if rows is None:
        docs.view_absent = True
        docs.view_lost = sorted(live)
        return
    docs.view_rows = len(rows)
    rows = _view_records(rows)  # a chunked view's rows: one per version, its chunks joined
    count = Counter(r["doc_key"] for r in rows)
    docs.view_doubled = sorted(k for k, n in count.items() if n > 1)
    docs.view_other_topics = sum(1 for r in rows if r["topic"] != topic)
    docs.view_lost = sorted(set(live) - set(count))
    docs.view_extra = sorted(set(count) - set(live))
    for row in rows:
        want_version = live.get(row["doc_key"])
        if want_version is None:
            continue
        held = (row["partition"], row["offset"])
        if held != (want_version.partition, want_version.offset) or row["text"] != (
            want_version.text
        ):
            docs.view_stale.append(row["doc_key"])
    docs.view_stale = sorted(set(docs.view_stale))


def _view_records(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The view's rows, those of one version of a document (its chunks, in a chunked
    view) as one, its text a ChunkedText; a chunk twice stays apart (doubled)."""
    if not rows or "chunk" not in rows[0]:
        return rows
    versions: dict[tuple[str, str, int, int], list[dict[str, Any]]] = {}
    for row in rows:
        place = (row["doc_key"], row["topic"], row["partition"], row["offset"])
        versions.setdefault(place, []).append(row)
    found = []
    for chunks in versions.values():
        text = ChunkedText(
            (
                r["chunk"],
                r.get("chunk_count") or 0,
                r.get("char_start") or 0,
                r.get("char_end") or 0,
                r["text"],
                bool(r.get("truncated")),
            )
            for r in chunks
        )
        found.append({**chunks[0], "text": text})
        numbers = text.chunks
        found += [chunks[0]] * (len(numbers) - len(set(numbers)))  # a chunk twice: doubled
    return found


@dataclass
class IndexIds:
    # Places (partition, offset), or (partition, offset, chunk) in an index of chunks.
    held: Counter[tuple[int, ...]]  # the shard files' ids (this topic's), every version
    removed: set[tuple[int, ...]]  # ids the index no longer serves (superseded, deleted)


def index_ids(output: Path, topic: str) -> IndexIds | None:
    """The ids in the index's shard files and its removals; None: no index."""
    import numpy as np

    from sinks.index.shards import ids_of, read_index_file
    from sinks.index.store import IndexStore

    if not (output / "index").is_dir():
        return None
    store = IndexStore(output)
    meta = store.saved_meta()
    if meta is None:
        return None
    number = meta.topics.get(topic)
    decode = id_decoder(meta)

    def mine(ids: Iterable[int]) -> Iterable[tuple[int, ...]]:
        for vector_id in ids:
            topic_no, *place = decode(int(vector_id))
            if topic_no == number:
                yield tuple(place)

    held: Counter[tuple[int, ...]] = Counter()
    for shard in meta.shards:
        path = store.directory / shard.file
        held.update(mine(ids_of(read_index_file(path, shard.count))))
    removed: set[tuple[int, ...]] = set()
    for entry in meta.removed:
        removed.update(mine(np.load(store.directory / entry.file, allow_pickle=False)))
    return IndexIds(held, removed)


def check_index(docs: DocumentVerdict, want: Expected, scan: RowScan, ids: IndexIds | None) -> None:
    """Shard files: every non-deleted row once, no deleted row; served: the live versions."""
    flags = zip(scan.rows, scan.documents, strict=False)
    indexed: set[tuple[int, ...]] = set()
    deleted: set[tuple[int, ...]] = set()
    for (partition, offset, text), (_, gone) in flags:
        (deleted if gone else indexed).update(row_ids(partition, offset, text))
    if ids is None:
        docs.index = {"absent": 1 if indexed else 0}
        return
    # Served versions: an index of chunks serves a version by its chunks.
    served = {(key[0], key[1]) for key in set(ids.held) - ids.removed}
    live = want.live_places
    docs.index = {
        "missing": len(indexed - set(ids.held)),
        "doubled": sum(1 for n in ids.held.values() if n > 1),
        "extra": len(set(ids.held) - indexed - deleted),
        "deleted_rows_indexed": len(set(ids.held) & deleted),
        "served_not_live": len(served - live),
        "live_not_served": len(live - served),
    }


def run_purge(bootstrap: str, output: Path) -> dict[str, Any]:
    """`pipeline compact --purge --json`: its exit status and report."""
    rc, out, err = run_cli(
        ["compact", "--purge", "--output", str(output), "--json"], bootstrap, timeout_s=300
    )
    result: dict[str, Any] = {"rc": rc}
    try:
        result.update(json.loads(out))
    except ValueError:
        result["stdout"] = out[-1000:]
    if rc != 0:  # the exception's line and the pipeline's own, first
        lines = [line for line in err.strip().splitlines() if line.strip()]
        result["error"] = " | ".join(lines[-3:])[-1500:]
    return result
