"""Document and query prompts: read from the model's sentence-transformers config (or
given), prepended before tokenizing so that their tokens count, and recorded."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.core.errors import ModelError
from pipeline.model.embedder import Embedder
from pipeline.model.prompts import Prompts, read_prompts, resolve


def folder(tmp_path: Path, config: object | None) -> Path:
    if config is not None:
        (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (None, Prompts()),
        ({"prompts": {}}, Prompts()),
        (
            {"prompts": {"query": "query: ", "passage": "passage: "}},
            Prompts("passage: ", "query: "),
        ),
        (
            {"prompts": {"query": "q: ", "document": "d: ", "passage": "p: "}},
            Prompts("d: ", "q: "),
        ),
        ({"prompts": {"query": "q: ", "corpus": "c: "}}, Prompts("c: ", "q: ")),
        # bge: only queries get an instruction
        (
            {"prompts": {"query": "Represent this sentence for searching relevant passages: "}},
            Prompts("", "Represent this sentence for searching relevant passages: "),
        ),
        # default_prompt_name fills in what is not named, as encode() would apply it
        (
            {"prompts": {"classification": "c: "}, "default_prompt_name": "classification"},
            Prompts("c: ", "c: "),
        ),
        # an explicit empty prompt means none (no fallback), as in sentence-transformers
        (
            {"prompts": {"query": "", "document": "d: "}, "default_prompt_name": "document"},
            Prompts("d: ", ""),
        ),
    ],
)
def test_prompts_are_read_as_sentence_transformers_reads_them(
    tmp_path: Path, config: object, expected: Prompts
) -> None:
    assert read_prompts(folder(tmp_path, config)) == expected


def test_known_hub_ids_get_their_model_cards_prompts(tmp_path: Path) -> None:
    e5 = Prompts("passage: ", "query: ")
    assert read_prompts(tmp_path, "intfloat/multilingual-e5-small") == e5
    assert read_prompts(tmp_path, "intfloat/e5-base-v2") == e5
    assert read_prompts(tmp_path, "intfloat/e5-mistral-7b-instruct") == Prompts()
    assert read_prompts(tmp_path, "sentence-transformers/all-MiniLM-L6-v2") == Prompts()
    # what the folder says wins over the table
    folder(tmp_path, {"prompts": {"query": "", "document": ""}})
    assert read_prompts(tmp_path, "intfloat/multilingual-e5-small") == Prompts()


def test_flags_override_each_prompt(tmp_path: Path) -> None:
    path = folder(tmp_path, {"prompts": {"query": "query: ", "passage": "passage: "}})
    assert resolve(path, "x", None, None) == Prompts("passage: ", "query: ")
    assert resolve(path, "x", "", None) == Prompts("", "query: ")
    assert resolve(path, "x", "doc: ", "q: ") == Prompts("doc: ", "q: ")


def test_unreadable_config_is_a_model_error(tmp_path: Path) -> None:
    (tmp_path / "config_sentence_transformers.json").write_text("{not json")
    with pytest.raises(ModelError, match=r"config_sentence_transformers\.json"):
        read_prompts(tmp_path)


def with_prompts(embedder: Embedder, document: str, query: str) -> Embedder:
    """The session's model with other prompts (a shallow copy: nothing reloaded)."""
    clone = copy.copy(embedder)
    clone.info = dataclasses.replace(embedder.info, document_prompt=document, query_prompt=query)
    return clone


def test_the_prompt_is_prepended_and_its_tokens_count(embedder: Embedder) -> None:
    e5ish = with_prompts(embedder, "passage: ", "query: ")
    texts = ["Kafka keeps offsets per partition.", "short"]
    plain = embedder.tokenize(texts)
    prompted = e5ish.tokenize(texts)
    assert prompted.ids == embedder.tokenize(["passage: " + t for t in texts]).ids
    prompt_tokens = len(embedder.tokenize(["passage:"]).ids[0]) - 2  # less [CLS] [SEP]
    assert (prompted.lengths - plain.lengths).tolist() == [prompt_tokens] * 2
    assert prompted.total_tokens == plain.total_tokens + 2 * prompt_tokens  # budgets see them
    assert (
        e5ish.tokenize(texts, "query: ").ids
        == embedder.tokenize(["query: " + t for t in texts]).ids
    )
    assert e5ish.tokenize(texts, "").ids == plain.ids


def test_a_long_text_is_cut_never_the_prompt(embedder: Embedder) -> None:
    e5ish = with_prompts(embedder, "passage: ", "query: ")
    long_text = " ".join(["stream"] * 1000)
    (ids,) = e5ish.tokenize([long_text]).ids
    assert len(ids) == embedder.info.max_length
    head = embedder.tokenize(["passage:"]).ids[0][:-1]  # [CLS] passage : (no [SEP])
    assert ids[: len(head)] == head


def test_documents_and_queries_embed_with_their_prompts(embedder: Embedder) -> None:
    e5ish = with_prompts(embedder, "passage: ", "query: ")
    text = ["how many partitions does the topic have"]
    np.testing.assert_allclose(
        e5ish.embed(text), embedder.embed(["passage: " + text[0]]), atol=1e-6
    )
    np.testing.assert_allclose(
        e5ish.embed_queries(text), embedder.embed(["query: " + text[0]]), atol=1e-6
    )
    assert not np.allclose(e5ish.embed(text), embedder.embed(text), atol=1e-3)


def test_load_takes_prompts_and_records_them() -> None:
    loaded = Embedder.load("default", "fp32", "cpu", document_prompt="doc: ", query_prompt="")
    try:
        assert loaded.info.document_prompt == "doc: "
        assert loaded.info.query_prompt == ""
        meta = loaded.info.as_metadata()
        assert meta["document_prompt"] == "doc: " and meta["query_prompt"] == ""
    finally:
        loaded.close()
