"""`pipeline model check`: what the worker will run, and whether it is what
sentence-transformers gives.

`plan` describes a ModelSpec (architecture, encoder, module stack, dimensions,
length, prompts, identity) without loading anything. `against_reference` embeds
sample texts, and texts longer than the model's own limit, with the pipeline and
with `SentenceTransformer(folder).encode(texts, prompt=<the document prompt>)` where
sentence-transformers is installed, and compares the vectors row by row: values,
norms and cosines (`compare`). One command to run before embedding a corpus with a
model the pipeline has not seen.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.model.gate import cosine_rows
from pipeline.model.spec import ModelSpec

log = logging.getLogger(__name__)

# At fp32 the pipeline computes sentence-transformers' function: the vectors are equal
# to rounding (docs/models.md has the differences measured). Values are compared
# relative to their own size plus the row's RMS (a value near zero carries the row's
# rounding, not its own), norms relative to the norm; a missing Normalize, another
# pooling's scale or any per-row factor moves a norm, not a cosine.
VALUE_RTOL = 1e-4
NORM_RTOL = 1e-4
PARITY_MIN_COSINE = 0.9999
_TINY = float(np.finfo(np.float32).tiny)
# Beside the corpus sample: text the sample lacks (CJK, accents, case, a tiny text).
EXTRA_TEXTS = (
    "向量检索服务把文本编码成稠密向量，再用近似最近邻索引召回。",
    "混合语言 text: Kafka 消费者按 micro-batch 写入 Parquet 和 FAISS。",
    "Crème brûlée, ÉTÉ and naïve façades: ACCENTS and Capitals.",
    "x",
)
# Units of the texts past the model's limit (`past_the_limit`): numbered, so that each
# part of a long text differs and a cut at the other end shows.
_LONG_UNITS = (
    "({}) A long text past the model's own maximum length; it is cut where "
    "sentence-transformers cuts it, at the start or at the end.",
    "（第{}段）向量检索服务把文本编码成稠密向量。Crème brûlée, naïve façades — ÉTÉ.",
)
# A unit doubled this often (16M parts) is past any model's limit.
_MAX_DOUBLINGS = 24


@dataclass(frozen=True)
class Agreement:
    """How far one set of vectors is from another, row by row."""

    rows: int
    cosine_min: float
    cosine_mean: float
    value_error: float  # the largest |got - expected| / (|expected| + the row's RMS)
    norm_error: float  # the largest | |got| - |expected| | / |expected|

    @property
    def passed(self) -> bool:
        return (
            self.cosine_min >= PARITY_MIN_COSINE
            and self.value_error <= VALUE_RTOL
            and self.norm_error <= NORM_RTOL
        )

    def failures(self) -> list[str]:
        """What differs, in words (empty where the vectors are equal)."""
        found = []
        if self.cosine_min < PARITY_MIN_COSINE:
            found.append(f"cosine {self.cosine_min:.6f} < {PARITY_MIN_COSINE}")
        if self.value_error > VALUE_RTOL:
            found.append(f"values differ by {self.value_error:.1e} > {VALUE_RTOL:.0e}")
        if self.norm_error > NORM_RTOL:
            found.append(f"norms differ by {self.norm_error:.1e} > {NORM_RTOL:.0e}")
        return found

    def summary(self) -> str:
        return (
            f"cosine min {self.cosine_min:.6f}, mean {self.cosine_mean:.6f}; values within "
            f"{self.value_error:.1e}, norms within {self.norm_error:.1e}"
        )


def compare(got: np.ndarray, expected: np.ndarray) -> Agreement:
    """Row by row: cosines, values and norms of `got` against `expected`; vectors of
    other shapes (dimensions) differ everywhere."""
    got = np.asarray(got, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if got.shape != expected.shape or got.ndim != 2:
        return Agreement(len(got), -1.0, -1.0, float("inf"), float("inf"))
    cosines = cosine_rows(got, expected)
    norms, expected_norms = np.linalg.norm(got, axis=1), np.linalg.norm(expected, axis=1)
    rms = expected_norms / np.sqrt(max(expected.shape[1], 1))
    scale = np.abs(expected) + rms[:, None]
    values = np.abs(got - expected) / np.maximum(scale, _TINY)
    norm_errors = np.abs(norms - expected_norms) / np.maximum(expected_norms, _TINY)
    return Agreement(
        len(got),
        float(cosines.min(initial=1.0)),
        float(cosines.mean()) if len(cosines) else 1.0,
        float(values.max(initial=0.0)),
        float(norm_errors.max(initial=0.0)),
    )


@dataclass(frozen=True)
class Parity:
    """The pipeline's vectors against sentence-transformers'."""

    texts: int
    past_limit: int  # of them, texts longer than the model's limit
    max_length: int
    cosine_min: float
    cosine_mean: float
    value_error: float
    norm_error: float
    reference: str  # "sentence-transformers X.Y.Z"

    @property
    def agreement(self) -> Agreement:
        return Agreement(
            self.texts, self.cosine_min, self.cosine_mean, self.value_error, self.norm_error
        )

    @property
    def passed(self) -> bool:
        return self.agreement.passed

    def describe(self) -> str:
        """One line: the verdict, against what, on what, and the differences."""
        failures = self.agreement.failures()
        verdict = f"DIFFERENT ({'; '.join(failures)})" if failures else "PASS"
        return (
            f"{verdict}: to {self.reference} on {self.texts} texts, {self.past_limit} past "
            f"the {self.max_length}-token limit (fp32, CPU): {self.agreement.summary()} "
            f"(pass: cosine >= {PARITY_MIN_COSINE}, values and norms within {VALUE_RTOL:.0e})"
        )


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
        "similarity": stack.similarity,
        "dimensions": spec.dim,
        "model_dimensions": stack.output_dimension,
        "max_length": spec.max_length,
        "lower_case": stack.transformer.do_lower_case,
        "padding_side": spec.tokenizer.padding_side,
        "document_prompt": spec.prompts.document,
        "query_prompt": spec.prompts.query,
        "weights": spec.revision,
        "tokenizer": spec.tokenizer_fingerprint,
        "identity": spec.identity,
    }


def render_plan(values: dict[str, Any]) -> list[str]:
    encoder = values["encoder"] + (f" ({values['encoder_note']})" if values["encoder_note"] else "")
    dims = f"{values['dimensions']}"
    if values["dimensions"] != values["model_dimensions"]:
        dims += f" (Matryoshka: the first of {values['model_dimensions']}, not normalised again)"
    modules = values["modules"] + ("" if values["modules_declared"] else " (no modules.json)")
    rows = [
        ("model", f"{values['model']} ({values['path']})"),
        ("architecture", f"{values['architecture']} (model_type {values['model_type']})"),
        ("encoder", encoder),
        ("modules", modules),
        ("pooling", values["pooling"] + ("" if values["include_prompt"] else ", prompt excluded")),
        ("normalised", _normalised(values)),
        ("similarity", f"{values['similarity']} (search ranks by it)"),
        ("dimensions", dims),
        ("max length", f"{values['max_length']} tokens"),
        ("lower-cased", "yes" if values["lower_case"] else "as the tokenizer does"),
        ("prompts", f"document {values['document_prompt']!r}, query {values['query_prompt']!r}"),
        ("weights", values["weights"]),
        ("tokenizer", values["tokenizer"]),
        ("identity", values["identity"]),
    ]
    return [f"{name:<13}{value}" for name, value in rows]


def _normalised(values: dict[str, Any]) -> str:
    if not values["normalized"]:
        return "no"
    cut = values["dimensions"] != values["model_dimensions"]
    return "yes (L2), before the cut, as truncate_dim does" if cut else "yes (L2)"


def reference_available() -> bool:
    return importlib.util.find_spec("sentence_transformers") is not None


def against_reference(embedder: Any, texts: list[str]) -> Parity:
    """The pipeline's document vectors of `texts` and of texts past the model's limit
    (`past_the_limit`) against sentence-transformers' own (its encode, with the same
    prompt), on the CPU at fp32: values, norms and cosines."""
    import sentence_transformers
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    spec: ModelSpec = embedder.spec
    long = past_the_limit(spec)
    texts = [*texts, *long]
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
    found = compare(embedder.embed(texts), np.asarray(expected, dtype=np.float32))
    return Parity(
        len(texts),
        len(long),
        spec.max_length,
        found.cosine_min,
        found.cosine_mean,
        found.value_error,
        found.norm_error,
        f"sentence-transformers {sentence_transformers.__version__}",
    )


def past_the_limit(spec: ModelSpec) -> list[str]:
    """Texts longer than the model's own limit, ASCII and not: numbered parts, as many
    as the model's tokenizer (without a limit) needs to pass it."""
    tokenizer = spec.tokenizer.backend(None)
    texts = []
    for unit in _LONG_UNITS:
        for doubling in range(_MAX_DOUBLINGS):
            text = " ".join(unit.format(i) for i in range(2**doubling))
            if len(tokenizer.encode(text).ids) > spec.max_length:
                texts.append(text)
                break
    return texts
