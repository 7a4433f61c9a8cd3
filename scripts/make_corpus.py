#!/usr/bin/env python3
"""Writes the sample corpus (real English paragraphs from the Python standard library's
docstrings, built offline) as JSONL. The logic lives in `pipeline.core.corpus`.

    .venv/bin/python scripts/make_corpus.py --out corpus.jsonl [--limit N] [--seed S]
"""

import sys

from pipeline.core.corpus import main

if __name__ == "__main__":
    sys.exit(main())
