"""How the index compares vectors: the model's similarity, as sentence-transformers has it.

A model names its similarity in `config_sentence_transformers.json`
(`similarity_fn_name`, cosine when it names none), and `SentenceTransformer.similarity`
ranks by it. The index is built for it, and `pipeline search` gives its scores:

| similarity  | FAISS index                            | score shown                 |
| ----------- | -------------------------------------- | --------------------------- |
| `cosine`    | inner product over L2-normalised vectors | the cosine                |
| `dot`       | inner product over the stored vectors  | the dot product             |
| `euclidean` | L2 over the stored vectors             | minus the L2 distance       |
| `manhattan` | L1 over the stored vectors             | minus the L1 distance       |

The Parquet files keep the vectors the model gave (sentence-transformers' `encode`);
only the index's copies of a cosine model's vectors are normalised, as its
`cos_sim` normalises them (x / max(|x|, 1e-12)). FAISS gives squared L2 distances:
the square root is taken here, so scores are what `SentenceTransformer.similarity`
gives. IVF-PQ has no L1 (FAISS's PQ scanners compute L2 and inner products only):
`--index-type ivf-pq` for a manhattan model is refused.

An index built before the similarity was recorded (`similarity` absent or null in
index.json: LEGACY) is an inner product over the stored vectors, whatever the model.
It answers a `dot` model, and a `cosine` model whose stored vectors are unit length
(`normalization` "l2": every model ending in Normalize); for any other model,
search refuses in one line and asks for `pipeline index rebuild`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pipeline.core.errors import IndexStateError
from pipeline.core.model_info import COSINE, DOT, EUCLIDEAN, MANHATTAN, NORMALIZED, SIMILARITIES

# FAISS's MetricType values (faiss/MetricType.h), fixed there; tests compare them.
METRIC_INNER_PRODUCT = 0
METRIC_L2 = 1
METRIC_L1 = 2
LEGACY: str | None = None
_METRICS = {
    COSINE: METRIC_INNER_PRODUCT,
    DOT: METRIC_INNER_PRODUCT,
    EUCLIDEAN: METRIC_L2,
    MANHATTAN: METRIC_L1,
    LEGACY: METRIC_INNER_PRODUCT,
}
METRIC_NAMES = {METRIC_INNER_PRODUCT: "inner product", METRIC_L2: "L2", METRIC_L1: "L1"}
# The index types (sinks.index.shards) that cannot search by a similarity, and why.
UNSUPPORTED = {
    ("ivf-pq", MANHATTAN): "FAISS's IVF-PQ computes no L1 distance; use ivf or flat",
}


def checked(similarity: str | None, where: str = "index.json") -> str | None:
    """`similarity` if it is one of SIMILARITIES (or LEGACY), else an IndexStateError."""
    if similarity is not LEGACY and similarity not in SIMILARITIES:
        raise IndexStateError(
            f"{where}: similarity {similarity!r} is not one of {', '.join(SIMILARITIES)}"
        )
    return similarity


def faiss_metric(similarity: str | None) -> int:
    return _METRICS[checked(similarity)]


def describe(similarity: str | None) -> str:
    """The similarity and how the index computes it, for messages and reports."""
    if similarity is LEGACY:
        return "inner product over the stored vectors (built before similarities were recorded)"
    if similarity == COSINE:
        return "cosine (inner product over L2-normalised vectors)"
    if similarity == DOT:
        return "dot (inner product)"
    return f"{similarity} (minus the {METRIC_NAMES[faiss_metric(similarity)]} distance)"


def check_index_type(index_type: str, similarity: str | None) -> None:
    """Refuses, in one line, an index type that cannot search by `similarity`."""
    why = UNSUPPORTED.get((index_type, similarity or ""))
    if why is not None:
        raise IndexStateError(f"a {index_type} index cannot search by {similarity}: {why}")


def prepare(vectors: np.ndarray, similarity: str | None) -> np.ndarray:
    """The vectors as the index holds (and is queried with) them: float32, C order,
    L2-normalised for cosine as sentence-transformers' cos_sim normalises them."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if similarity != COSINE or not vectors.size:
        return vectors
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return np.ascontiguousarray(vectors / np.maximum(norms, np.float32(1e-12)), np.float32)


def scores(distances: np.ndarray, similarity: str | None) -> np.ndarray:
    """FAISS's distances as similarities, higher nearer (as SentenceTransformer.similarity)."""
    metric = faiss_metric(similarity)
    if metric == METRIC_INNER_PRODUCT:
        return distances
    if metric == METRIC_L2:  # FAISS gives the squared distance
        return -np.sqrt(np.maximum(distances, 0))
    return -distances


def legacy_answers(model_similarity: str, model: Mapping[str, str]) -> bool:
    """Whether an index built before similarities were recorded (an inner product over
    the stored vectors) ranks as `model_similarity` does, for the recorded `model`."""
    if model_similarity == DOT:
        return True
    return model_similarity == COSINE and model.get("normalization") == NORMALIZED
