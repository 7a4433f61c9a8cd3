"""`pipeline search`: embed a query with the output's own model and look it up.

The index ranks by the similarity the output records (the model's
`similarity_fn_name`: sinks.index.metric) and the scores are that similarity, as
`SentenceTransformer.similarity` gives it: a cosine, a dot product, or minus a
euclidean or manhattan distance. An index built before similarities were recorded
(an inner product over the stored vectors) is searched where that is the model's
ranking (dot; cosine over unit-length vectors) and refused in one line, with the
rebuild that makes it right, where it is not.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from pipeline.core.documents import DOC_KEY
from pipeline.core.errors import IndexStateError
from pipeline.core.layout import describe, segments_by_partition
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
    output: Path, query: str, k: int, device: str = "auto", query_prompt: str | None = None
) -> list[dict[str, Any]]:
    """`query_prompt` None: the one the output recorded (outputs from before prompts:
    the model's own, pipeline.model.prompts)."""
    return search(output, query, k, device, query_prompt).hits


def search(
    output: Path, query: str, k: int, device: str = "auto", query_prompt: str | None = None
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
    if has_view(output):  # upsert mode: live documents only
        return Found(similarity, _live_hits(output, store, vector, k, legacy_as))
    hits = store.search(vector, k, legacy_as)[0]
    # Read again if a compaction exchanged the files meanwhile (sinks.vectors_swap).
    rows = read_consistently(output, lambda: [_row(output, hit) for hit in hits])
    found = [dict(row, score=hit.score) for row, hit in zip(rows, hits, strict=True)]
    return Found(similarity, found)


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
    output: Path, store: IndexStore, vector: Any, k: int, legacy_as: str | None
) -> list[dict[str, Any]]:
    """The best k hits that are live versions in the current view (sinks.view): the index
    may still hold versions the view has since superseded or deleted, so it is asked
    for more until k live ones are found or it has no more."""
    view = ViewStore(output)
    fetch = k
    while True:
        hits = store.search(vector, fetch, legacy_as)[0]
        where = [(h.topic, h.partition, h.offset) for h in hits]
        rows = view.live(where, [DOC_KEY, *_ROW_COLUMNS]).to_pylist()
        by_place = {(r["topic"], r["partition"], r["offset"]): r for r in rows}
        found = [
            dict(_decoded(by_place[place]), score=hit.score)
            for place, hit in zip(where, hits, strict=True)
            if place in by_place
        ]
        if len(found) >= k or len(hits) < fetch or fetch >= store.ntotal:
            return found[:k]
        fetch *= 4


def _decoded(row: dict[str, Any]) -> dict[str, Any]:
    row["key"] = row["key"].decode("utf-8", "replace") if row["key"] else None
    return row


def _row(output: Path, hit: Hit) -> dict[str, Any]:
    """The Parquet row of a hit: in the last segment starting at or before its offset."""
    segments = segments_by_partition(output, [hit.topic]).get((hit.topic, hit.partition), [])
    # Newest first: with legacy overlapping files, any one holding the offset will do.
    for segment in sorted(segments, key=lambda s: s.key.first, reverse=True):
        if segment.key.first > hit.offset:
            continue
        try:
            table, _ = read_rows(segment, _ROW_COLUMNS)
        except (DamagedSegment, FileNotFoundError):
            continue
        row = table.filter(pc.equal(table["offset"], hit.offset)).to_pylist()
        if row:
            return _decoded(row[0])
    raise IndexStateError(
        f"index entry {hit.topic}[{hit.partition}]@{hit.offset} has no Parquet row; "
        f"run: pipeline index rebuild --output {describe(output)}"
    )
