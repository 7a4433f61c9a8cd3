"""What every output records about the model its vectors came from.

The fields are written into each segment's footer (`embedding.*`) and the index's
metadata; sinks.identity compares them with a worker's model before it adds vectors,
and pipeline.model.spec computes them from a model's files.
"""

from __future__ import annotations

from dataclasses import dataclass

# How vectors are compared, as sentence-transformers names and defines them
# (`similarity_fn_name` in config_sentence_transformers.json; SentenceTransformer.similarity):
# cosine of the vectors, their dot product, minus their euclidean (L2) distance, minus
# their manhattan (L1) distance. Higher is more similar in all four.
COSINE = "cosine"
DOT = "dot"
EUCLIDEAN = "euclidean"
MANHATTAN = "manhattan"
SIMILARITIES = (COSINE, DOT, EUCLIDEAN, MANHATTAN)
DEFAULT_SIMILARITY = COSINE  # a model that names none, as sentence-transformers does
# `normalization` of the stored vectors: unit length, or a normalising model's vectors
# cut to their first `truncate_dim` values after the normalisation (Matryoshka, as
# sentence-transformers' truncate_dim stores them), or as the model left them.
NORMALIZED = "l2"
NORMALIZED_THEN_CUT = "l2-before-truncation"
NOT_NORMALIZED = "none"


@dataclass(frozen=True)
class ModelInfo:
    """What the Parquet metadata says about the vectors."""

    name: str
    path: str
    revision: str
    dim: int
    pooling: str
    # Whether the model's module stack ends in Normalize (the stored vectors are then
    # unit length unless cut by `truncate_dim`: see `normalization`).
    normalize: bool
    max_length: int
    precision: str
    device: str
    # Prepended to every text before tokenizing (pipeline.model.prompts): documents are
    # what the worker embeds, queries what `pipeline search` embeds.
    document_prompt: str = ""
    query_prompt: str = ""
    # The module stack as sentence-transformers runs it, and the hash of everything
    # that decides a vector (ModelSpec.identity); "" where unknown (tests, old outputs).
    modules: str = ""
    identity: str = ""
    # Matryoshka: the stored vectors are the first `truncate_dim` values (None: all).
    truncate_dim: int | None = None
    # The model's similarity_fn_name (one of SIMILARITIES): what the index searches by.
    similarity: str = DEFAULT_SIMILARITY
    # The tokenizer as transformers built it (ModelSpec.tokenizer_fingerprint, part of
    # `identity`), and the identity as releases before it computed it: not recorded,
    # compared with outputs that record no `tokenizer` (sinks.identity).
    tokenizer: str = ""
    legacy_identity: str = ""
    # What ran the network ("torch" or "openvino"), and how an int8 model was made
    # from the weights (pipeline.model.openvino_engine.RECIPE; "" for float).
    engine: str = "torch"
    calibration: str = ""

    @property
    def normalization(self) -> str:
        """What the stored vectors are: NORMALIZED, NORMALIZED_THEN_CUT or NOT_NORMALIZED."""
        if not self.normalize:
            return NOT_NORMALIZED
        return NORMALIZED if self.truncate_dim is None else NORMALIZED_THEN_CUT

    def as_metadata(self) -> dict[str, str]:
        return {
            "model": self.name,
            "model_revision": self.revision,
            "precision": self.precision,
            "pooling": self.pooling,
            "normalization": self.normalization,
            "dim": str(self.dim),
            "max_length": str(self.max_length),
            "device": self.device,
            "document_prompt": self.document_prompt,
            "query_prompt": self.query_prompt,
            "modules": self.modules,
            "model_identity": self.identity,
            "truncate_dim": "" if self.truncate_dim is None else str(self.truncate_dim),
            "similarity": self.similarity,
            "tokenizer": self.tokenizer,
            "engine": self.engine,
            "calibration": self.calibration,
        }
