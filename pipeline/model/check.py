"""`pipeline model check`: what the worker will run, and whether it is what
sentence-transformers gives.

`plan` describes a ModelSpec (architecture, encoder, module stack, dimensions,
length, prompts, identity) without loading anything. `against_reference` embeds
sample texts with the pipeline and with `SentenceTransformer(folder).encode(texts,
prompt=<the document prompt>)` where sentence-transformers is installed, and gives
the cosines row by row: one command to run before embedding a corpus with a model
the pipeline has not seen.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.model.precision import cosine_rows as _cosines
from pipeline.model.spec import ModelSpec

log = logging.getLogger(__name__)

# At fp32 the pipeline and sentence-transformers compute the same function; rounding
# alone moves a cosine by far less than this.
PARITY_MIN_COSINE = 0.9999
# Beside the corpus sample: text the sample lacks (CJK, accents, case, a text long
# enough to be cut at any usual maximum length).
EXTRA_TEXTS = (
    "向量检索服务把文本编码成稠密向量，再用近似最近邻索引召回。",
    "混合语言 text: Kafka 消费者按 micro-batch 写入 Parquet 和 FAISS。",
    "Crème brûlée, ÉTÉ and naïve façades: ACCENTS and Capitals.",
    "x",
    " ".join(["a long text that every usual maximum length cuts"] * 120),
)


@dataclass(frozen=True)
class Parity:
    texts: int
    cosine_min: float
    cosine_mean: float
    reference: str  # "sentence-transformers X.Y.Z"

    @property
    def passed(self) -> bool:
        return self.cosine_min >= PARITY_MIN_COSINE


def plan(spec: ModelSpec) -> dict[str, Any]:
    """What the worker runs for this model, as printable values."""
    from pipeline.model import network

    why_not_native = network.native_applies(spec)
    stack = spec.stack
    return {
        "model": spec.name,
        "path": str(spec.path),
        "architecture": spec.architecture,
        "model_type": spec.model_type,
        "encoder": "native" if why_not_native is None else "transformers",
        "encoder_note": why_not_native or "",
        "modules": stack.describe(),
        "modules_declared": stack.declared,
        "pooling": stack.pooling.label,
        "include_prompt": stack.pooling.include_prompt,
        "normalized": stack.normalized,
        "dimensions": spec.dim,
        "model_dimensions": stack.output_dimension,
        "max_length": spec.max_length,
        "lower_case": stack.transformer.do_lower_case,
        "padding_side": spec.tokenizer.padding_side,
        "document_prompt": spec.prompts.document,
        "query_prompt": spec.prompts.query,
        "weights": spec.revision,
        "identity": spec.identity,
    }


def render_plan(values: dict[str, Any]) -> list[str]:
    encoder = values["encoder"] + (f" ({values['encoder_note']})" if values["encoder_note"] else "")
    dims = f"{values['dimensions']}"
    if values["dimensions"] != values["model_dimensions"]:
        dims += f" (Matryoshka: the first of {values['model_dimensions']})"
    modules = values["modules"] + ("" if values["modules_declared"] else " (no modules.json)")
    rows = [
        ("model", f"{values['model']} ({values['path']})"),
        ("architecture", f"{values['architecture']} (model_type {values['model_type']})"),
        ("encoder", encoder),
        ("modules", modules),
        ("pooling", values["pooling"] + ("" if values["include_prompt"] else ", prompt excluded")),
        ("normalised", "yes (L2)" if values["normalized"] else "no"),
        ("dimensions", dims),
        ("max length", f"{values['max_length']} tokens"),
        ("lower-cased", "yes" if values["lower_case"] else "as the tokenizer does"),
        ("prompts", f"document {values['document_prompt']!r}, query {values['query_prompt']!r}"),
        ("weights", values["weights"]),
        ("identity", values["identity"]),
    ]
    return [f"{name:<13}{value}" for name, value in rows]


def reference_available() -> bool:
    return importlib.util.find_spec("sentence_transformers") is not None


def against_reference(embedder: Any, texts: list[str]) -> Parity:
    """Cosines of the pipeline's document vectors against sentence-transformers' own
    (its encode, with the same prompt and truncation), on the CPU at fp32."""
    import sentence_transformers
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    spec: ModelSpec = embedder.spec
    reference = SentenceTransformer(
        str(spec.path),
        device="cpu",
        local_files_only=True,
        trust_remote_code=False,
        truncate_dim=spec.truncate_dim,
    )
    # The document prompt as given, "" included: sentence-transformers' encode_document
    # (an empty document prompt wins over a default_prompt_name).
    expected = reference.encode(
        texts,
        prompt=spec.prompts.document,
        convert_to_numpy=True,
        batch_size=32,
        show_progress_bar=False,
    )
    got = embedder.embed(texts)
    cosines = cosine_rows(got, np.asarray(expected, dtype=np.float32))
    return Parity(
        len(texts),
        float(cosines.min()),
        float(cosines.mean()),
        f"sentence-transformers {sentence_transformers.__version__}",
    )


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row cosines; -1 for every row where the two have other shapes (dimensions)."""
    return _cosines(a, b) if a.shape == b.shape else np.full(len(a), -1.0)
