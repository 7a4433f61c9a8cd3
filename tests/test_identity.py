"""Model identity: every output records its model, and a worker refuses to add
vectors of another identity (weights, pooling, normalisation, max length, document
prompt, int8 against float) at start-up, before it consumes anything."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import OutputError
from pipeline.core.layout import SegmentKey
from pipeline.core.model_info import ModelInfo
from pipeline.core.records import GoodRecord, SourceRecord
from sinks.identity import check_output_model, differences, recorded_model
from sinks.parquet import ParquetSink
from tests.helpers import (
    committed_offsets,
    corpus_records,
    output_rows,
    publish_json,
    run_until_end,
    truncate,
)

DIM = 8
MODEL = ModelInfo(
    name="sentence-transformers/all-MiniLM-L6-v2",
    path="/models/minilm",
    revision="sha256:0123456789abcdef",
    dim=DIM,
    pooling="mean",
    normalize=True,
    max_length=256,
    precision="fp32",
    device="cpu",
)


def other(**changes: object) -> ModelInfo:
    return dataclasses.replace(MODEL, **changes)


def publish_segment(output: Any, model: ModelInfo, first: int = 0, n: int = 3) -> Path:
    sink = ParquetSink(output, model)
    if isinstance(output, Path):
        sink.prepare()
    records = [
        GoodRecord(SourceRecord("t", 0, o, 0, None, b"{}"), f"text {o}", None, None)
        for o in range(first, first + n)
    ]
    vectors = np.eye(n, model.dim, dtype=np.float32)
    staged = sink.stage(SegmentKey("t", 0, first), first + n - 1, records, vectors, n)
    assert sink.publish(staged)
    return staged.final_path


def test_the_footer_records_the_whole_identity(tmp_path: Path) -> None:
    model = other(document_prompt="passage: ", query_prompt="query: ")
    path = publish_segment(tmp_path, model)
    meta = {
        k.decode(): v.decode()
        for k, v in (pq.read_schema(path).metadata or {}).items()
        if k.startswith(b"embedding.")
    }
    assert meta["embedding.model"] == MODEL.name
    assert meta["embedding.model_revision"] == MODEL.revision
    assert meta["embedding.pooling"] == "mean"
    assert meta["embedding.normalization"] == "l2"
    assert meta["embedding.max_length"] == "256"
    assert meta["embedding.precision"] == "fp32"
    assert meta["embedding.document_prompt"] == "passage: "
    assert meta["embedding.query_prompt"] == "query: "
    assert recorded_model(tmp_path) == {k.removeprefix("embedding."): v for k, v in meta.items()}


def test_an_empty_output_has_no_recorded_model(tmp_path: Path) -> None:
    assert recorded_model(tmp_path) is None
    check_output_model(tmp_path, MODEL, str(tmp_path))  # nothing to compare with


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"revision": "sha256:fedcba9876543210"}, "weights sha256:0123456789abcdef"),
        ({"pooling": "cls"}, "pooling mean -> cls"),
        ({"normalize": False}, "normalisation l2 -> none"),
        ({"max_length": 512}, "max length 256 -> 512"),
        ({"document_prompt": "passage: "}, "document prompt '' -> 'passage: '"),
        ({"precision": "int8"}, "precision fp32 -> int8"),
        ({"dim": 16, "revision": "sha256:1111111111111111"}, "dimension 8 -> 16"),
        ({"modules": "Transformer > Pooling(cls)"}, "module stack"),
        ({"truncate_dim": 4, "dim": 4}, "Matryoshka dimensions"),
        ({"identity": "sha256:2222222222222222"}, "model identity"),
    ],
)
def test_another_identity_is_refused_in_one_line(
    tmp_path: Path, changes: dict[str, object], named: str
) -> None:
    publish_segment(tmp_path, MODEL)
    with pytest.raises(OutputError) as caught:
        check_output_model(tmp_path, other(**changes), str(tmp_path))
    message = str(caught.value)
    assert named in message
    assert "\n" not in message
    assert "new --output and a new --group" in message
    assert "--model default" in message  # how to add to this output instead
    assert caught.value.exit_code == 73


def test_same_weights_at_another_precision_or_name_are_one_identity(tmp_path: Path) -> None:
    """fp32, bf16 and fp16 pass the precision gate against each other (cosine >= 0.995):
    a bf16 GPU worker may join fp32 CPU workers. The name is not the weights."""
    publish_segment(tmp_path, MODEL)
    for same in (
        other(precision="bf16"),
        other(precision="fp16", device="cuda"),
        other(name="/somewhere/else/minilm", path="/somewhere/else/minilm"),
        other(query_prompt="query: "),  # changes no stored vector
    ):
        assert differences(recorded_model(tmp_path) or {}, same) == []
        check_output_model(tmp_path, same, str(tmp_path))


def test_outputs_from_before_prompts_had_none() -> None:
    legacy = {k: v for k, v in MODEL.as_metadata().items() if not k.endswith("_prompt")}
    assert differences(legacy, MODEL) == []
    assert differences(legacy, other(document_prompt="passage: ")) == [
        "document prompt '' -> 'passage: '"
    ]


def test_outputs_from_before_module_stacks_were_recorded_skip_them() -> None:
    legacy = {
        k: v
        for k, v in MODEL.as_metadata().items()
        if k not in ("modules", "model_identity", "truncate_dim")
    }
    assert differences(legacy, other(modules="Transformer > Pooling(mean)", identity="x")) == []


def test_the_refusal_says_which_dimensions_to_run_with(tmp_path: Path) -> None:
    publish_segment(tmp_path, other(truncate_dim=4, dim=4))
    with pytest.raises(OutputError, match=r"--dimensions 4"):
        check_output_model(tmp_path, MODEL, "out")


def test_the_refusal_says_which_prompt_to_run_with(tmp_path: Path) -> None:
    e5 = other(name="multilingual-e5-small", document_prompt="passage: ")
    publish_segment(tmp_path, e5)
    with pytest.raises(OutputError, match=r"--model multilingual-e5-small --document-prompt "):
        check_output_model(tmp_path, other(name="multilingual-e5-small"), "out")


def test_damaged_and_vanished_footers_are_skipped(tmp_path: Path) -> None:
    publish_segment(tmp_path, MODEL, first=0)
    newest = publish_segment(tmp_path, MODEL, first=3)
    truncate(newest)
    assert recorded_model(tmp_path) is not None  # the older one answers
    with pytest.raises(OutputError, match="weights"):
        check_output_model(tmp_path, other(revision="sha256:ffffffffffffffff"), "out")


@pytest.mark.integration
@pytest.mark.s3
def test_an_s3_output_is_checked_alike(s3_url: str) -> None:
    """On an object store the record is one ranged read of the last object's footer."""
    from sinks.objectstore import ObjectStore

    store = ObjectStore.from_url(s3_url)
    publish_segment(store, MODEL)
    recorded = recorded_model(store)
    assert recorded is not None and recorded["model_revision"] == MODEL.revision
    check_output_model(store, other(precision="bf16"))
    with pytest.raises(OutputError) as caught:
        check_output_model(store, other(document_prompt="passage: "))
    assert str(caught.value).startswith(s3_url.rstrip("/") + " holds vectors of")


# ------------------------------------------------------------- on the real broker


@pytest.mark.integration
def test_worker_refuses_another_identity_before_consuming(
    broker: str, make_topic, group_id: str, tmp_path: Path, tiny_model: str
) -> None:
    """Same weights, same dimension, another document prompt: the vectors would not
    compare, so the second worker exits 73 with one line and consumes nothing."""
    topic = make_topic(partitions=2)
    output = tmp_path / "out"
    publish_json(broker, topic, corpus_records(20), partitions=2)
    first = run_until_end(broker, topic, group_id, output, "--model", tiny_model)
    assert first.returncode == 0, first.stderr[-2000:]
    assert len(output_rows(output)) == 20
    index_model = json.loads((output / "index" / "index.json").read_text())["model"]
    assert index_model["document_prompt"] == "" and index_model["query_prompt"] == ""

    publish_json(broker, topic, corpus_records(10, seed=1), partitions=2)
    before = committed_offsets(broker, group_id, topic)
    refused = run_until_end(
        broker, topic, group_id, output, "--model", tiny_model, "--document-prompt", "passage: "
    )
    assert refused.returncode == 73, refused.stderr[-2000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, refused.stderr[-2000:]
    assert "document prompt '' -> 'passage: '" in errors[0]
    assert "Traceback" not in refused.stderr
    # Refused from the model's files, before its weights were loaded.
    assert " loaded: " not in refused.stderr
    assert committed_offsets(broker, group_id, topic) == before
    assert len(output_rows(output)) == 20

    again = run_until_end(broker, topic, group_id, output, "--model", tiny_model)
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(output_rows(output)) == 30
