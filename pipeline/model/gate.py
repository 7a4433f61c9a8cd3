"""The precision gate's figures: a lower precision's (or another engine's) vectors
against fp32's on the same texts, and the thresholds they must meet
(pipeline.model.precision applies them; pipeline.model.int8_margin asks a margin
over them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_MIN_COSINE = 0.995
DEFAULT_MIN_RECALL = 0.95


@dataclass(frozen=True)
class Gate:
    min_cosine_mean: float = DEFAULT_MIN_COSINE
    min_recall_at_10: float = DEFAULT_MIN_RECALL


DEFAULT_GATE = Gate()


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    num = (a * b).sum(axis=1)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return num / np.maximum(den, 1e-12)


def neighbour_recall(reference: np.ndarray, candidate: np.ndarray, k: int = 10) -> float:
    """Mean overlap of each row's k nearest neighbours (itself excluded) in both sets."""
    k = min(k, len(reference) - 1)
    if k <= 0:
        return 1.0

    def top_k(vectors: np.ndarray) -> np.ndarray:
        unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        sims = unit @ unit.T
        np.fill_diagonal(sims, -np.inf)
        return np.argpartition(-sims, k, axis=1)[:, :k]

    ref, cand = top_k(reference), top_k(candidate)
    overlap = [len(set(r) & set(c)) for r, c in zip(ref, cand, strict=True)]
    return float(np.mean(overlap) / k)
