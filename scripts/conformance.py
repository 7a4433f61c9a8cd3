#!/usr/bin/env python3
"""The conformance table: every model of tests/model_zoo.py (random weights, built
here, no network) through the pipeline and through sentence-transformers, side by
side: at fp32 the largest difference of values and of norms (relative, as
pipeline.model.check.compare measures them) and the lowest cosine, at the reduced
CPU precisions the lowest cosine; or the one line a refused model gets.
tests/test_conformance.py asserts the same; this prints it.

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


def row_for(folder: Path, texts: list[str], refused: str | None = None) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    from pipeline.core.errors import PipelineError
    from pipeline.model.check import compare
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
        found = compare(embedder.embed(texts), np.asarray(expected))
        row[precision] = round(found.cosine_min, 6)
        if precision == "fp32":
            row |= {"values": found.value_error, "norms": found.norm_error, "equal": found.passed}
        embedder.close()
    return row


def render(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"{'model':<34}{'architecture':<20}{'encoder':<13}{'values':>9}{'norms':>9}{'fp32':>10}"
        f"{'bf16':>9}{'int8':>9}  module stack / refusal"
    ]
    for r in rows:
        if "refused" in r:
            lines.append(f"{r['model']:<34}{'refused (exit 72)':<51}  {r['refused'][:150]}")
            continue
        lines.append(
            f"{r['model']:<34}{r['architecture']:<20}{r['encoder']:<13}{r['values']:>9.1e}"
            f"{r['norms']:>9.1e}{r['fp32']:>10.6f}{r['bf16']:>9.5f}{r['int8']:>9.5f}"
            f"  {r['modules']}"
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
    print(f"the pipeline's vectors against sentence-transformers' on {len(texts)} texts (CPU): "
          "at fp32 the largest relative difference of values and of norms and the lowest "
          "cosine, at bf16 and int8 the lowest cosine")  # fmt: skip
    print("\n".join(render(rows)))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    bad = [r["model"] for r in rows if not r["expected_refusal"] or not r.get("equal", True)]
    if bad:
        print(f"NOT CONFORMING: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
