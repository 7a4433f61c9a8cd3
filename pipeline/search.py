"""`pipeline search`: embed a query with the output's own model and look it up.

The index ranks by the similarity the output records (the model's
`similarity_fn_name`: sinks.index.metric) and the scores are that similarity, as
`SentenceTransformer.similarity` gives it: a cosine, a dot product, or minus a
euclidean or manhattan distance. An index built before similarities were recorded
(an inner product over the stored vectors) is searched where that is the model's
ranking (dot; cosine over unit-length vectors) and refused in one line, with the
rebuild that makes it right, where it is not.

In an output of chunks (`pipeline run --chunk-tokens`: several rows per record, one
vector each) hits are documents: the best-scoring chunk of each record, with its
span (`chunk`, `chunk_count`, `char_start`, `char_end`); the index is asked for more
than k chunks until k distinct records are found or it has no more. `chunks=True`
gives the chunk hits themselves, each its own row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.core.chunks import CHAR_END, CHAR_START, CHUNK, CHUNK_COUNT, SPAN_COLUMNS
from pipeline.core.documents import DOC_KEY
from pipeline.core.errors import IndexStateError
from pipeline.core.layout import SegmentFile, describe, segments_by_partition
from pipeline.core.model_info import NORMALIZED
from pipeline.model.embedder import Embedder
from sinks.identity import comparable_identity
from sinks.index import metric as metrics
from sinks.index.store import Hit, IndexStore
from sinks.segments import DamagedSegment, read_rows
from sinks.vectors_swap import read_consistently
from sinks.view import ViewStore, has_view

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Found:
    """The hits of a query: rows of the output with their `score`, by `similarity`."""

    similarity: str
    hits: list[dict[str, Any]]


def search_output(
    output: Path,
    query: str,
    k: int,
    device: str = "auto",
    query_prompt: str | None = None,
    chunks: bool = False,
) -> list[dict[str, Any]]:
    """`query_prompt` None: the one the output recorded (outputs from before prompts:
    the model's own, pipeline.model.prompts). `chunks`: in an output of chunks, the
    k best chunks rather than the k best documents."""
    return search(output, query, k, device, query_prompt, chunks).hits


def search(
    output: Path,
    query: str,
    k: int,
    device: str = "auto",
    query_prompt: str | None = None,
    chunks: bool = False,
) -> Found:
    """search_output, with the similarity its scores are."""
    store = IndexStore(output, use_gpu=device != "cpu")
    store.load()
    assert store.meta is not None
    model = store.meta.model
    embedder = Embedder.load(
        _model_name(model),
        precision="fp32",
        device="cpu" if device == "auto" else device,
        document_prompt=model.get("document_prompt"),
        query_prompt=query_prompt if query_prompt is not None else model.get("query_prompt"),
        dimensions=int(model["truncate_dim"]) if model.get("truncate_dim") else None,
    )
    for key, ours in (
        ("model_revision", embedder.info.revision),
        ("model_identity", comparable_identity(model, embedder.info)),
    ):
        if model.get(key, ours) != ours:
            raise IndexStateError(
                f"the index was built with {model.get('model')} ({key} {model.get(key)}), "
                f"but that model now loads as {ours}"
            )
    similarity, legacy_as = _similarity(output, store.meta.similarity, model, embedder.info)
    vector = embedder.embed_queries([query])
    return Found(similarity, find(output, store, vector, k, legacy_as, chunks))


def find(
    output: Path,
    store: IndexStore,
    vector: np.ndarray,
    k: int,
    legacy_as: str | None = None,
    chunks: bool = False,
) -> list[dict[str, Any]]:
    """The rows nearest `vector` (one query, as the model embeds it), each with its
    `score`: the k nearest records; in an output of chunks, the best chunk of each of
    the k nearest records, with its span (`chunks`: the k nearest chunks)."""
    if store.meta is None:
        store.load()
    assert store.meta is not None
    chunked = store.meta.chunks
    group = chunked and not chunks
    if has_view(output):  # upsert mode: live documents only
        return _live_hits(output, store, vector, k, legacy_as, group, chunked)
    hits = _nearest(store, vector, k, legacy_as, group)
    # Read again if a compaction exchanged the files meanwhile (sinks.vectors_swap).
    rows = read_consistently(output, lambda: _rows(output, hits, chunked))
    return [dict(row, score=hit.score) for row, hit in zip(rows, hits, strict=True)]


def _nearest(
    store: IndexStore,
    vector: np.ndarray,
    k: int,
    legacy_as: str | None,
    group: bool,
    admit: Callable[[list[Hit]], list[Hit]] | None = None,
) -> list[Hit]:
    """The k best hits (with `group`, of distinct records: each one's best chunk) of
    those `admit` keeps (None: all): the index is asked for more until k are found or
    it has no more."""
    fetch = k
    while True:
        hits = store.search(vector, fetch, legacy_as)[0]
        kept = admit(hits) if admit is not None else hits
        if group:
            kept = best_per_record(kept)
        if len(kept) >= k or len(hits) < fetch or fetch >= store.ntotal:
            return kept[:k]
        fetch = min(fetch * 4, max(store.ntotal, 1))


def best_per_record(hits: Sequence[Hit]) -> list[Hit]:
    """Of hits ranked best first, the first (best) of each record (topic, partition,
    offset), in that order."""
    seen: set[tuple[str, int, int]] = set()
    best = []
    for hit in hits:
        if hit.place not in seen:
            seen.add(hit.place)
            best.append(hit)
    return best


def _similarity(
    output: Path, recorded: str | None, model: dict[str, str], info: Any
) -> tuple[str, str | None]:
    """(the similarity the scores are, the one a legacy index is searched as)."""
    if recorded is not None:
        if recorded != info.similarity:
            log.warning(
                "the index of %s searches by %s, as its vectors were embedded; the model now "
                "names %s (pipeline index rebuild --similarity %s changes the index)",
                describe(output),
                recorded,
                info.similarity,
                info.similarity,
            )
        return recorded, None
    ours = info.similarity
    if not metrics.legacy_answers(ours, model):
        vectors = (
            "unit-length vectors"
            if model.get("normalization") == NORMALIZED
            else "vectors that are not unit length"
        )
        raise IndexStateError(
            f"the index of {describe(output)} was built before similarities were recorded, as "
            f"an inner product over {vectors}, and {model.get('model', 'the model')} ranks by "
            f"{ours}; run: pipeline index rebuild --output {describe(output)}"
        )
    return ours, ours


def _model_name(model_meta: dict[str, str]) -> str:
    name = model_meta.get("model", "default")
    return "default" if name == "sentence-transformers/all-MiniLM-L6-v2" else name


_ROW_COLUMNS = ["topic", "partition", "offset", "id", "text", "key", "timestamp"]


def _live_hits(
    output: Path,
    store: IndexStore,
    vector: Any,
    k: int,
    legacy_as: str | None,
    group: bool = False,
    chunked: bool = False,
) -> list[dict[str, Any]]:
    """The best k hits that are live versions in the current view (sinks.view): the index
    may still hold versions the view has since superseded or deleted, so it is asked
    for more until k live ones are found or it has no more. A record is live where the
    view holds it (topic, partition, offset); in an output of chunks, a hit's row is
    the view's row of its chunk, or the segments' where the view has none."""
    view = ViewStore(output)
    spans = [c for c in SPAN_COLUMNS if c in _view_columns(view)] if chunked else []
    columns = [DOC_KEY, *_ROW_COLUMNS, *spans]
    live: dict[tuple[str, int, int], dict[str, Any]] = {}  # a row of each live record
    by_chunk: dict[tuple[str, int, int, int], dict[str, Any]] = {}
    asked: set[tuple[str, int, int]] = set()

    def admit(hits: list[Hit]) -> list[Hit]:
        where = list(dict.fromkeys(h.place for h in hits if h.place not in asked))
        asked.update(where)
        for row in view.live(where, columns).to_pylist():
            place = (row["topic"], row["partition"], row["offset"])
            live.setdefault(place, row)
            by_chunk[(*place, int(row.get(CHUNK) or 0))] = row
        return [h for h in hits if h.place in live]

    hits = _nearest(store, vector, k, legacy_as, group, admit)
    found: list[dict[str, Any] | None] = []
    for hit in hits:
        row = by_chunk.get((*hit.place, hit.chunk)) if not chunked or spans else None
        found.append(None if row is None else _decoded(dict(row)))
    missing = [h for h, r in zip(hits, found, strict=True) if r is None]
    if missing:  # chunks the view holds no row of: their rows in the segments
        read = iter(read_consistently(output, lambda: _rows(output, missing, chunked)))
        found = [r if r is not None else next(read) for r in found]
    return [
        dict(row, **{DOC_KEY: row.get(DOC_KEY, live[hit.place][DOC_KEY])}, score=hit.score)
        for row, hit in zip(found, hits, strict=True)
        if row is not None
    ]


def _view_columns(view: ViewStore) -> set[str]:
    dataset = view.dataset()
    return set() if dataset is None else set(dataset.schema.names)


def _decoded(row: dict[str, Any]) -> dict[str, Any]:
    row["key"] = row["key"].decode("utf-8", "replace") if row["key"] else None
    return row


def _rows(output: Path, hits: Sequence[Hit], chunked: bool = False) -> list[dict[str, Any]]:
    """The Parquet row of each hit (its chunk's, in an output of chunks: with the span),
    each segment read once."""
    listed: dict[str, dict[tuple[str, int], list[SegmentFile]]] = {}
    tables: dict[str, pa.Table | None] = {}
    rows = []
    for hit in hits:
        if hit.topic not in listed:
            listed[hit.topic] = segments_by_partition(output, [hit.topic])
        segments = listed[hit.topic].get((hit.topic, hit.partition), [])
        rows.append(_row(output, hit, segments, tables, chunked))
    return rows


def _row(
    output: Path,
    hit: Hit,
    segments: Sequence[SegmentFile],
    tables: dict[str, pa.Table | None],
    chunked: bool,
) -> dict[str, Any]:
    """The Parquet row of a hit: in the last segment starting at or before its offset,
    at its offset and chunk."""
    # Newest first: with legacy overlapping files, any one holding the offset will do.
    for segment in sorted(segments, key=lambda s: s.key.first, reverse=True):
        if segment.key.first > hit.offset:
            continue
        name = str(segment.path)
        if name not in tables:
            try:
                tables[name] = read_rows(
                    segment, _ROW_COLUMNS, optional=SPAN_COLUMNS if chunked else ()
                )[0]
            except (DamagedSegment, FileNotFoundError):
                tables[name] = None
        table = tables[name]
        if table is None:
            continue
        at = pc.equal(table["offset"], hit.offset)
        if CHUNK in table.column_names:
            at = pc.and_(at, pc.equal(table[CHUNK], hit.chunk))
        elif hit.chunk:
            continue
        row = table.filter(at).to_pylist()
        if row:
            return _spanned(_decoded(row[0])) if chunked else _decoded(row[0])
    where = f"{hit.topic}[{hit.partition}]@{hit.offset}"
    raise IndexStateError(
        f"index entry {where}{f' chunk {hit.chunk}' if chunked else ''} has no Parquet row; "
        f"run: pipeline index rebuild --output {describe(output)}"
    )


def _spanned(row: dict[str, Any]) -> dict[str, Any]:
    """A row of an output of chunks with its span: a row from before chunks (a segment
    without them) is its record's one chunk."""
    if row.get(CHUNK) is None:
        row.update({CHUNK: 0, CHUNK_COUNT: 1, CHAR_START: 0, CHAR_END: len(row["text"])})
    return row
