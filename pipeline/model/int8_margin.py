"""Whether a model keeps a margin over the precision gate with its feed-forward
down-projections in int8 too (pipeline.model.openvino_engine.SMOOTHED_DOWN).

Those layers are a third of a pass's matmul work: in int8 they make a pass faster,
and they cost recall about evenly across kinds of text (docs/performance.md: the
down-projections in int8 where the model keeps the margin). The gate's sample is
English. So the default recipe quantises them only for a model that keeps MARGIN
over the gate's recall with them: a model already near the gate keeps them in float,
as its Chinese or mixed text would fall under it.

Measured once per model and release, when SMOOTHED_DOWN is converted: its sentence
vectors (the model's own pooling) against fp32 torch's, on stdlib paragraphs that
neither the smoothing's calibration nor the gate's sample holds; the verdict is kept
in the converted model's folder (VERDICT), so every later start reads it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.model.gate import (
    DEFAULT_MIN_COSINE,
    DEFAULT_MIN_RECALL,
    cosine_rows,
    neighbour_recall,
)
from pipeline.model.shapes import sorted_batches
from pipeline.model.spec import ModelSpec

VERDICT = "margin.json"
# Enough paragraphs that recall@10 tells MiniLM (in int8) from multilingual-e5 (not):
# on 300 the two read too close (docs/performance.md).
TEXTS = 1500
# recall@10 over the gate's, on the sample: the most that Chinese or mixed text fell
# below English with these layers in int8, on the models measured.
MARGIN = 0.012
_BATCH = 16


@dataclass(frozen=True)
class Verdict:
    cosine_mean: float
    recall_at_10: float
    texts: int

    @property
    def holds(self) -> bool:
        return (
            self.cosine_mean >= DEFAULT_MIN_COSINE
            and self.recall_at_10 >= DEFAULT_MIN_RECALL + MARGIN
        )

    def describe(self) -> str:
        verdict = "in int8" if self.holds else "kept in float"
        return (
            f"the down-projections {verdict}: with them in int8, recall@10 "
            f"{self.recall_at_10:.3f} and cosine mean {self.cosine_mean:.5f} against fp32 "
            f"on {self.texts} paragraphs (the margin asks {MARGIN} over the gate's recall)"
        )

    def write(self, folder: Path) -> None:
        (folder / VERDICT).write_text(json.dumps(asdict(self)) + "\n")


def read(folder: Path) -> Verdict | None:
    """The verdict kept in a converted model's folder; None where there is none, or
    one measured on another sample than this release's."""
    try:
        verdict = Verdict(**json.loads((folder / VERDICT).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return verdict if verdict.texts == TEXTS else None


def sample(calibration: int) -> list[str]:
    """Stdlib paragraphs before the smoothing's `calibration` texts (the last of
    pipeline.core.corpus's order), after the gate's (the first)."""
    from pipeline.core.corpus import calibration_texts

    return calibration_texts(calibration + TEXTS)[:TEXTS]


def measure(spec: ModelSpec, net: Any, native: bool, compiled: Any, calibration: int) -> Verdict:
    """`compiled` (the int8 model, compiled: hidden(ids, mask)) against the fp32 torch
    network `net`, as sentence vectors, on `sample(calibration)`."""
    import torch

    from pipeline.model import network
    from pipeline.model.head import Head

    tokenizer = spec.tokenizer.backend(spec.max_length)
    rows = [e.ids for e in tokenizer.encode_batch(sample(calibration))]
    head = Head(spec.stack, spec.truncate_dim)
    pad = spec.tokenizer.pad_token_id or 0
    expected, got = [], []
    with torch.inference_mode():
        for ids, mask in sorted_batches(rows, pad, _BATCH):
            real = torch.from_numpy(mask)
            hidden = network.forward(net, native, torch.from_numpy(ids), real)
            expected.append(head(hidden, real).numpy())
            with compiled.hidden(ids, mask) as states:
                got.append(head(states, real).numpy())
    reference, vectors = np.concatenate(expected), np.concatenate(got)
    return Verdict(
        float(cosine_rows(reference, vectors).mean()),
        neighbour_recall(reference, vectors),
        len(rows),
    )
