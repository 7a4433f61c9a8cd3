"""Document and query prompts: the prefixes models such as e5, bge and gte expect.

e5 was trained on "passage: <text>" for what is searched and "query: <text>" for
what searches; without them its vectors are worse. A model folder names its
prompts in `config_sentence_transformers.json`:

    {"prompts": {"query": "query: ", "document": "passage: "}, "default_prompt_name": null}

read as sentence-transformers reads them: the query prompt is "query"; the
document prompt the first of "document", "passage", "corpus"; either, when
missing, falls back to the prompt "default_prompt_name" names. Folders that name
no prompts at all get them from `KNOWN` when their name is a known hub id (e5's
model cards ask for the prefixes, but not every upload writes them down), else
none. `--document-prompt` / `--query-prompt` override all of this ("" for none).

A prompt is prepended to the text before it is tokenised, as in
sentence-transformers, so its tokens count: against the model's maximum length
(the text is cut, never the prompt) and against every token budget. The worker
records both prompts in each output (Parquet `embedding.document_prompt` /
`embedding.query_prompt`, and the index's model metadata); `pipeline search`
applies the recorded query prompt.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.errors import ModelError

CONFIG_FILE = "config_sentence_transformers.json"
DOCUMENT_NAMES = ("document", "passage", "corpus")

# Hub ids whose model cards ask for prompts their folders may not record.
KNOWN: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (
        re.compile(r"^intfloat/(multilingual-)?e5-(small|base|large)(-v2)?$"),
        "passage: ",
        "query: ",
    ),
)


@dataclass(frozen=True)
class Prompts:
    document: str = ""
    query: str = ""


def read_prompts(path: Path, name: str = "") -> Prompts:
    """The folder's prompts (see the module's docstring); Prompts() when it names none."""
    config_file = path / CONFIG_FILE
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        config = {}
    except (OSError, ValueError) as exc:
        raise ModelError(f"{config_file} is not readable JSON: {exc}") from exc
    prompts = config.get("prompts") if isinstance(config, dict) else None
    prompts = {k: v for k, v in (prompts or {}).items() if isinstance(v, str)}
    if not prompts:
        return known_prompts(name)
    default = prompts.get(str(config.get("default_prompt_name") or ""))
    query = prompts.get("query", default)
    document = next((prompts[n] for n in DOCUMENT_NAMES if n in prompts), default)
    return Prompts(document or "", query or "")


def known_prompts(name: str) -> Prompts:
    for pattern, document, query in KNOWN:
        if pattern.match(name):
            return Prompts(document, query)
    return Prompts()


def resolve(
    path: Path, name: str, document: str | None = None, query: str | None = None
) -> Prompts:
    """The folder's prompts, each replaced by the one given (None: keep the folder's)."""
    found = read_prompts(path, name)
    return Prompts(
        found.document if document is None else document,
        found.query if query is None else query,
    )
