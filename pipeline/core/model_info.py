"""What every output records about the model its vectors came from.

The fields are written into each segment's footer (`embedding.*`) and the index's
metadata; sinks.identity compares them with a worker's model before it adds vectors,
and pipeline.model.spec computes them from a model's files.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    """What the Parquet metadata says about the vectors."""

    name: str
    path: str
    revision: str
    dim: int
    pooling: str
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

    def as_metadata(self) -> dict[str, str]:
        return {
            "model": self.name,
            "model_revision": self.revision,
            "precision": self.precision,
            "pooling": self.pooling,
            "normalization": "l2" if self.normalize else "none",
            "dim": str(self.dim),
            "max_length": str(self.max_length),
            "device": self.device,
            "document_prompt": self.document_prompt,
            "query_prompt": self.query_prompt,
            "modules": self.modules,
            "model_identity": self.identity,
            "truncate_dim": "" if self.truncate_dim is None else str(self.truncate_dim),
        }
