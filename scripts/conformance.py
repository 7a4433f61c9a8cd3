#!/usr/bin/env python3
"""The conformance table: every model of tests/model_zoo.py (random weights, built
here, no network) through the pipeline and through sentence-transformers, side by
side: the row-wise cosine at fp32 and at the reduced CPU precisions, or the one line
a refused model gets. tests/test_conformance.py asserts the same; this prints it.

    .venv/bin/python scripts/conformance.py [--texts 60] [--json FILE] [--multilingual]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PRECISIONS = ("fp32", "bf16", "int8")


def cosine_min(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return -1.0
    rows = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
    return float(rows.min())


def row_for(folder: Path, texts: list[str], refused: str | None = None) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    from pipeline.core.errors import PipelineError
    from pipeline.model.embedder import Embedder

    row: dict[str, Any] = {"model": folder.name}
    try:
        embedders = {p: Embedder.load(str(folder), p, "cpu") for p in PRECISIONS}
    except PipelineError as exc:
        row["refused"] = str(exc).replace(str(folder.parent) + "/", "")
        row["expected_refusal"] = refused is not None and refused in str(exc)
        return row
    first = embedders["fp32"]
    row |= {
        "architecture": first.spec.architecture,
        "encoder": first.encoder,
        "modules": first.info.modules,
        "dim": first.info.dim,
        "expected_refusal": refused is None,
    }
    reference = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    expected = reference.encode(texts, prompt=first.info.document_prompt, show_progress_bar=False)
    for precision, embedder in embedders.items():
        row[precision] = round(cosine_min(embedder.embed(texts), np.asarray(expected)), 6)
        embedder.close()
    return row


def render(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"{'model':<34}{'architecture':<20}{'encoder':<13}{'fp32':>9}{'bf16':>9}{'int8':>9}"
        "  module stack / refusal"
    ]
    for r in rows:
        if "refused" in r:
            lines.append(f"{r['model']:<34}{'refused (exit 72)':<42}  {r['refused'][:150]}")
            continue
        lines.append(
            f"{r['model']:<34}{r['architecture']:<20}{r['encoder']:<13}"
            f"{r['fp32']:>9.6f}{r['bf16']:>9.5f}{r['int8']:>9.5f}  {r['modules']}"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=60, help="stdlib paragraphs beside the fixed")
    parser.add_argument("--multilingual", action="store_true", help="add multilingual-e5-small")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from tests import model_zoo

    texts = model_zoo.texts(extra=args.texts)
    rows = []
    with tempfile.TemporaryDirectory(prefix="zoo-") as root:
        for name, case in model_zoo.CASES.items():
            rows.append(row_for(model_zoo.build(name, Path(root)), texts, case.refused))
            print(json.dumps(rows[-1]), file=sys.stderr)
    if args.multilingual:
        from pipeline.model.spec import resolve_model_path

        rows.append(row_for(resolve_model_path("multilingual-e5-small")[1], texts))
    print(f"cosine of the pipeline's vectors to sentence-transformers' (fp32, CPU), "
          f"lowest of {len(texts)} texts")  # fmt: skip
    print("\n".join(render(rows)))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    bad = [r["model"] for r in rows if not r["expected_refusal"] or r.get("fp32", 1.0) < 0.9999]
    if bad:
        print(f"NOT CONFORMING: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
