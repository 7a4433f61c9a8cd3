"""Model identity: every output records its model, and a worker refuses to add
vectors of another identity (weights, pooling, normalisation, max length, document
prompt, int8 against float) at start-up, before it consumes anything."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import OutputError
from pipeline.core.layout import SegmentKey
from pipeline.core.model_info import ModelInfo
from pipeline.core.records import GoodRecord, SourceRecord
from pipeline.model.spec import ModelSpec
from sinks.identity import check_output_model, differences, recorded_model
from sinks.parquet import ParquetSink
from tests.helpers import (
    PIPELINE,
    committed_offsets,
    corpus_records,
    output_rows,
    publish_json,
    run_until_end,
    truncate,
    worker_env,
)

REPO = Path(__file__).resolve().parents[1]

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
    identity="sha256:aaaaaaaaaaaaaaaa",
    tokenizer="sha256:1111111111111111",
    legacy_identity="sha256:bbbbbbbbbbbbbbbb",
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
    assert meta["embedding.tokenizer"] == model.tokenizer
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
        ({"precision": "int8"}, "precision float -> int8"),
        ({"dim": 16, "revision": "sha256:1111111111111111"}, "dimension 8 -> 16"),
        ({"modules": "Transformer > Pooling(cls)"}, "module stack"),
        ({"truncate_dim": 4, "dim": 4}, "Matryoshka dimensions"),
        ({"identity": "sha256:2222222222222222"}, "model identity"),
        ({"tokenizer": "sha256:3333333333333333"}, "tokenizer"),
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


def test_int8_is_one_kind_per_recipe(tmp_path: Path) -> None:
    """An int8 output admits int8 made the same way only: not float, not the int8 of
    another recipe, nor an earlier release's (torch's dynamic quantisation, which
    recorded no calibration); `--precision auto` follows the kind an output holds, and
    int8 of another recipe is made by the release whose recipe it is."""
    from sinks.identity import int8_recipe_held, precision_held, precisions_of_kind

    assert precision_held(recorded_model(tmp_path)) is None  # empty: auto picks freely
    recipe = "nncf-int8-recipe-a"
    ours = other(precision="int8", engine="openvino", calibration=recipe)
    publish_segment(tmp_path, ours)
    assert precision_held(recorded_model(tmp_path)) == "int8"
    assert precisions_of_kind("int8") == ("int8",)
    check_output_model(tmp_path, other(precision="int8", engine="openvino", calibration=recipe))
    for refused, named in (
        (MODEL, "precision int8 (nncf-int8-recipe-a) -> float"),
        (other(precision="int8", calibration="recipe-b"), "-> int8 (recipe-b)"),
        (other(precision="int8"), "-> int8 (torch dynamic quantisation)"),
    ):
        with pytest.raises(OutputError, match=re.escape(named)) as caught:
            check_output_model(tmp_path, refused, str(tmp_path))
        # auto follows the output's kind; int8 of another recipe needs its release.
        remedy = "--precision auto" if refused is MODEL else "the release whose int8 recipe"
        assert remedy in str(caught.value)
    floats = tmp_path / "floats"
    publish_segment(floats, MODEL)
    held = precision_held(recorded_model(floats))
    assert precisions_of_kind(held or "") == ("fp32", "bf16", "fp16")
    # The recipe a worker makes int8 with for this output (where its release makes it).
    held_recipes = [int8_recipe_held(recorded_model(o)) for o in (tmp_path, floats)]
    assert held_recipes == [recipe, None]


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


# ------------------------------------------------------------- the tokenizer as built


def as_the_release_before(segment: Path, model: ModelInfo) -> None:
    """Rewrites a segment's footer as the release before wrote it: no tokenizer
    fingerprint, and the identity that release computed."""
    table = pq.read_table(segment)
    meta = dict(table.schema.metadata or {})
    del meta[b"embedding.tokenizer"]
    meta[b"embedding.model_identity"] = model.legacy_identity.encode()
    pq.write_table(table.replace_schema_metadata(meta), segment)


def test_an_output_of_the_release_before_is_matched_then_fingerprinted(tmp_path: Path) -> None:
    """Outputs of the release before record no tokenizer fingerprint: the same model
    adds to them (matched on the identity that release computed), and its segments
    record the fingerprint, which is compared from then on."""
    as_the_release_before(publish_segment(tmp_path, MODEL, first=0), MODEL)
    assert "tokenizer" not in (recorded_model(tmp_path) or {})
    check_output_model(tmp_path, MODEL, "out")
    with pytest.raises(OutputError, match="model identity sha256:bbbbbbbbbbbbbbbb -> sha256:c"):
        check_output_model(tmp_path, other(legacy_identity="sha256:cccccccccccccccc"), "out")

    publish_segment(tmp_path, MODEL, first=3)  # the worker's own, last by name
    rebuilt = other(tokenizer="sha256:3333333333333333", identity="sha256:dddddddddddddddd")
    with pytest.raises(OutputError, match="tokenizer sha256:1111111111111111 -> sha256:3333"):
        check_output_model(tmp_path, rebuilt, "out")


def built_otherwise(spec: ModelSpec) -> list[ModelSpec]:
    """The same model folder with its tokenizer built otherwise: what a transformers
    upgrade may do under the same files."""
    built = spec.tokenizer
    backend = json.loads(built.backend_json)
    backend["normalizer"]["strip_accents"] = not backend["normalizer"]["strip_accents"]
    changes = [
        {"truncation_side": "left"},
        {"padding_side": "left"},
        {"split_special_tokens": not built.split_special_tokens},
        {"special_ids": (*built.special_ids, 999)},
        {"backend_json": json.dumps(backend)},
    ]
    return [dataclasses.replace(spec, tokenizer=dataclasses.replace(built, **c)) for c in changes]


def test_the_tokenizer_as_built_is_part_of_the_identity(tiny_model: str) -> None:
    spec = ModelSpec.read(tiny_model)
    info = spec.info("fp32", "cpu")
    assert info.tokenizer == spec.tokenizer_fingerprint
    assert info.identity == spec.identity != spec.legacy_identity
    for rebuilt in built_otherwise(spec):
        assert rebuilt.tokenizer.files_hash == spec.tokenizer.files_hash
        assert rebuilt.identity != spec.identity
        # What the release before hashed could not tell them apart.
        assert rebuilt.legacy_identity == spec.legacy_identity
        found = differences(info.as_metadata(), rebuilt.info("fp32", "cpu"))
        assert [d.split()[0] for d in found] == ["tokenizer", "model"]


def test_what_makes_no_id_leaves_the_fingerprint(tiny_model: str) -> None:
    """The decoder (ids to text) and the order of the serialised keys make no id."""
    spec = ModelSpec.read(tiny_model)
    backend = json.loads(spec.tokenizer.backend_json)
    backend["decoder"] = None
    reordered = json.dumps(dict(reversed(list(backend.items()))))
    same = dataclasses.replace(
        spec, tokenizer=dataclasses.replace(spec.tokenizer, backend_json=reordered)
    )
    assert same.identity == spec.identity


def test_a_tokenizer_transformers_builds_otherwise_is_another_identity(
    tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ModelSpec.read: the same files, a tokenizer transformers builds with
    another normaliser (a new version, so a new resolved-tokenizer cache)."""
    from pipeline.model.tokenize import resolve

    before = ModelSpec.read(tiny_model)
    build = resolve._from_transformers

    def upgraded(*args: Any) -> Any:
        built = build(*args)
        backend = json.loads(built.backend_json)
        backend["normalizer"]["clean_text"] = not backend["normalizer"]["clean_text"]
        return dataclasses.replace(built, backend_json=json.dumps(backend))

    monkeypatch.setattr(resolve, "_from_transformers", upgraded)
    monkeypatch.setenv(resolve.CACHE_ENV, str(tmp_path / "cache"))
    after = ModelSpec.read(tiny_model)
    assert after.tokenizer.files_hash == before.tokenizer.files_hash
    assert after.revision == before.revision
    assert after.identity != before.identity
    assert after.legacy_identity == before.legacy_identity


def test_the_same_model_has_one_identity_twice_and_across_processes(
    tiny_model: str, tmp_path: Path
) -> None:
    """Read again, and in another process that resolves its tokenizer and hashes its
    weights anew (an empty metadata cache)."""
    from pipeline.model.tokenize.resolve import CACHE_ENV

    first, again = ModelSpec.read(tiny_model), ModelSpec.read(tiny_model)
    assert first.identity == again.identity
    code = (
        "import sys; from pipeline.model.spec import ModelSpec; "
        "print(ModelSpec.read(sys.argv[1]).identity)"
    )
    env = {**os.environ, CACHE_ENV: str(tmp_path / "fresh")}
    other_process = subprocess.run(
        [sys.executable, "-c", code, tiny_model],
        env=env, capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    assert other_process.stdout.strip().splitlines()[-1] == first.identity
    assert (tmp_path / "fresh").is_dir()  # resolved there, not read from this session's


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


@pytest.mark.integration
def test_a_worker_adds_to_an_output_of_the_release_before(
    broker: str, make_topic, group_id: str, tmp_path: Path, tiny_model: str
) -> None:
    """An output whose footers and index record no tokenizer fingerprint, as the release
    before wrote them: the same model adds to it, its new segments record the
    fingerprint, and search answers from it."""
    topic = make_topic(partitions=1)
    output = tmp_path / "out"
    publish_json(broker, topic, corpus_records(10), partitions=1)
    first = run_until_end(broker, topic, group_id, output, "--model", tiny_model)
    assert first.returncode == 0, first.stderr[-2000:]
    info = ModelSpec.read(tiny_model).info("fp32", "cpu")
    before = sorted((output / "vectors").glob("*.parquet"))
    for segment in before:
        as_the_release_before(segment, info)
    index = output / "index" / "index.json"
    meta = json.loads(index.read_text())
    del meta["model"]["tokenizer"]
    meta["model"]["model_identity"] = info.legacy_identity
    index.write_text(json.dumps(meta))

    publish_json(broker, topic, corpus_records(5, seed=1), partitions=1)
    again = run_until_end(broker, topic, group_id, output, "--model", tiny_model)
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(output_rows(output)) == 15
    added = sorted(set((output / "vectors").glob("*.parquet")) - set(before))
    assert added
    for segment in added:
        footer = pq.read_schema(segment).metadata or {}
        assert footer[b"embedding.tokenizer"].decode() == info.tokenizer
        assert footer[b"embedding.model_identity"].decode() == info.identity
    found = subprocess.run(
        [*PIPELINE, "search", "--output", str(output), "-k", "3", "--json", "text"],
        env=worker_env(broker), cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert found.returncode == 0, found.stderr[-2000:]
    assert len(json.loads(found.stdout)["hits"]) == 3


@pytest.mark.integration
def test_a_worker_adds_to_an_int8_output_with_the_recipe_it_holds(
    broker: str, make_topic, group_id: str, tmp_path: Path, tiny_model: str
) -> None:
    """An int8 output made with the first OpenVINO recipe (the default of releases
    before smoothing): a worker of this release adds to it with that recipe, not with
    its own default, which the output would refuse."""
    from pipeline.model.openvino_engine import FIRST, RECIPE

    assert FIRST.name != RECIPE
    output = tmp_path / "out"
    publish_segment(output, ModelSpec.read(tiny_model).info("int8", "cpu", "openvino", FIRST.name))
    before = set((output / "vectors").glob("*.parquet"))
    topic = make_topic(partitions=1)
    publish_json(broker, topic, corpus_records(12), partitions=1)
    run = run_until_end(
        broker, topic, group_id, output, "--model", tiny_model, "--precision", "int8"
    )
    assert run.returncode == 0, run.stderr[-2000:]
    added = sorted(set((output / "vectors").glob("*.parquet")) - before)
    assert added
    for segment in added:
        footer = pq.read_schema(segment).metadata or {}
        assert footer[b"embedding.calibration"].decode() == FIRST.name
    assert sum(pq.read_metadata(p).num_rows for p in added) == 12
