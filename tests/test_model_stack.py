"""A model folder's module stack, read as sentence-transformers reads it: every key a
module's config holds is reproduced, accepted by name as changing no vector, or
refused by name (ModelError, one line, exit 72); the widths of the whole stack are
checked at start, where sentence-transformers pools what the transformer gives
whatever the Pooling config says.

The models are copies of the tiny random BERT (scripts/tiny_model.py: Transformer >
Pooling(mean) > Normalize, hidden size 32), edited file by file."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.core.errors import ModelError
from pipeline.model.spec import ModelSpec

HIDDEN = 32
TEXTS = ["The quick brown fox.", "x", "Kafka offsets are committed after the outputs are durable."]
ST_MODULES = "sentence_transformers.models."


@pytest.fixture
def folder(tiny_model: str, tmp_path: Path) -> Path:
    """A copy of the tiny model, to edit."""
    return Path(shutil.copytree(tiny_model, tmp_path / "model"))


def edit_json(path: Path, change: Callable[[Any], Any] | dict[str, Any]) -> None:
    value = json.loads(path.read_text()) if path.is_file() else {}
    value = change(value) if callable(change) else {**value, **change}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def add_module(folder: Path, kind: str, config: dict[str, Any], shapes: dict | None = None) -> Path:
    """Appends a module (its config, and random weights of `shapes`) to modules.json."""
    modules = json.loads((folder / "modules.json").read_text())
    path = f"{len(modules)}_{kind}"
    modules.append({"idx": len(modules), "name": str(len(modules)), "path": path,
                    "type": ST_MODULES + kind})  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    edit_json(folder / path / "config.json", config)
    if shapes is not None:
        from safetensors.numpy import save_file

        rng = np.random.default_rng(0)
        tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        save_file(tensors, str(folder / path / "model.safetensors"))
    return folder / path


def without_normalize(folder: Path) -> None:
    edit_json(folder / "modules.json", lambda modules: modules[:2])


def refusal(folder: Path) -> str:
    with pytest.raises(ModelError) as refused:
        ModelSpec.read(str(folder))
    message = str(refused.value)
    assert "\n" not in message
    assert refused.value.exit_code == 72
    return message


# ------------------------------------------------------------------ one rule for every key


def dense(folder: Path, **extra: Any) -> Path:
    without_normalize(folder)
    config = {"in_features": HIDDEN, "out_features": 16, "bias": True,
              "activation_function": "torch.nn.modules.activation.Tanh", **extra}  # fmt: skip
    shapes = {"linear.weight": (16, HIDDEN), "linear.bias": (16,)}
    return add_module(folder, "Dense", config, shapes)


def layer_norm(folder: Path, **extra: Any) -> Path:
    without_normalize(folder)
    shapes = {"norm.weight": (HIDDEN,), "norm.bias": (HIDDEN,)}
    return add_module(folder, "LayerNorm", {"dimension": HIDDEN, **extra}, shapes)


def normalize(folder: Path, **extra: Any) -> Path:
    edit_json(folder / "2_Normalize" / "config.json", extra)
    return folder / "2_Normalize"


def dropout(folder: Path, **extra: Any) -> Path:
    return add_module(folder, "Dropout", {"dropout": 0.1, **extra})


def pooling(folder: Path, **extra: Any) -> Path:
    edit_json(folder / "1_Pooling" / "config.json", extra)
    return folder / "1_Pooling"


def transformer(folder: Path, **extra: Any) -> Path:
    edit_json(folder / "sentence_bert_config.json", extra)
    return folder


MODULES = {
    "Dense": dense,
    "LayerNorm": layer_norm,
    "Normalize": normalize,
    "Dropout": dropout,
    "Pooling": pooling,
    "Transformer": transformer,
}


@pytest.mark.parametrize(
    ("kind", "key", "value"),
    [
        ("Dense", "init_weight", [[0.0]]),
        ("Dense", "dropout", 0.5),
        ("LayerNorm", "eps", 1e-5),
        ("Normalize", "p", 1),
        ("Dropout", "inplace", True),
        ("Pooling", "mystery", 1),
        ("Transformer", "tokenizer_name_or_path", "bert-base-cased"),
    ],
)
def test_a_setting_no_module_reproduces_is_refused_by_name(
    folder: Path, kind: str, key: str, value: Any
) -> None:
    """One rule for every module: a key not understood is refused, naming it and the
    file, never ignored (Dense, LayerNorm and Normalize used to ignore them)."""
    where = MODULES[kind](folder, **{key: value})
    message = refusal(folder)
    assert key in message and kind in message
    assert str(where) in message


@pytest.mark.parametrize("kind", list(MODULES))
def test_each_module_reads_with_the_keys_sentence_transformers_writes(
    folder: Path, kind: str
) -> None:
    MODULES[kind](folder)
    spec = ModelSpec.read(str(folder))
    assert spec.dim == (16 if kind == "Dense" else HIDDEN)


@pytest.mark.parametrize(
    ("kind", "config", "named"),
    [
        ("Dense", {"bias": "yes"}, "bias"),
        ("Dense", {"use_residual": 1}, "use_residual"),
        ("Dense", {"activation_function": None}, "activation"),
        ("Dense", {"module_input_name": "token_embeddings"}, "module_input_name"),
        ("Normalize", {"module_input_name": "token_embeddings"}, "module_input_name"),
        ("Pooling", {"include_prompt": "no"}, "include_prompt"),
        ("Pooling", {"pooling_mode": 3}, "pooling_mode"),
        ("Transformer", {"do_lower_case": "yes"}, "do_lower_case"),
        ("Transformer", {"model_args": {"torch_dtype": "int4"}}, "torch_dtype"),
    ],
)
def test_a_value_not_reproduced_is_refused_by_name(
    folder: Path, kind: str, config: dict[str, Any], named: str
) -> None:
    MODULES[kind](folder, **config)
    assert named in refusal(folder)


def test_harmless_keys_are_accepted_by_name(folder: Path) -> None:
    """Keys that change no vector: sentence-transformers' own bookkeeping (idx, an
    empty list of a module's encode() arguments), flash-attention unpadding, what its
    load call replaces (backend, and the hub arguments of model_args: revision,
    trust_remote_code, ...) and kernels that compute the same function."""
    transformer(
        folder,
        unpad_inputs=True,
        backend="onnx",
        cache_dir="/elsewhere",
        model_args={"revision": "v2", "trust_remote_code": True, "attn_implementation": "eager",
                    "subfolder": "x", "torch_dtype": "float32"},
        config_args={"revision": "v2", "token": "t"},
    )  # fmt: skip
    edit_json(folder / "modules.json", lambda ms: [{**m, "kwargs": []} for m in ms])
    dropout(folder)
    spec = ModelSpec.read(str(folder))
    assert spec.stack.transformer.kwargs("model_kwargs") == {}
    assert spec.stack.transformer.kwargs("config_kwargs") == {}
    assert spec.stack.describe() == "Transformer > Pooling(mean) > Normalize"


@pytest.mark.parametrize(
    ("entry", "named"), [({"device": "cpu"}, "device"), ({"kwargs": ["task"]}, "'task'")]
)
def test_a_modules_json_entry_key_not_understood_is_refused(
    folder: Path, entry: dict[str, Any], named: str
) -> None:
    """Unknown entry keys, and encode() arguments a module would be given (encode_document
    passes task="document" to a module that lists it)."""
    edit_json(folder / "modules.json", lambda ms: [ms[0], {**ms[1], **entry}, ms[2]])
    message = refusal(folder)
    assert "modules.json" in message and named in message


def test_the_old_argument_names_win_whole_as_in_sentence_transformers(folder: Path) -> None:
    """Transformer._load_init_kwargs: where a file has model_args and model_kwargs, the
    old name replaces the new one (not merged)."""
    transformer(folder, model_args={"add_pooling_layer": False}, model_kwargs={"other": 1})
    spec = ModelSpec.read(str(folder))
    assert spec.stack.transformer.kwargs("model_kwargs") == {"add_pooling_layer": False}


def test_a_dtype_in_model_args_is_said_not_dropped(
    folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """sentence-transformers computes in model_args' torch_dtype (fp16 on the CPU too);
    the pipeline computes at --precision: said in a warning naming it."""
    transformer(folder, model_args={"torch_dtype": "float16"})
    with caplog.at_level(logging.WARNING, logger="pipeline.model.stack"):
        spec = ModelSpec.read(str(folder))
    assert spec.stack.transformer.kwargs("model_kwargs") == {}
    assert any("torch_dtype" in r.getMessage() and "float16" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_a_revision_in_model_args_is_what_sentence_transformers_overrides(folder: Path) -> None:
    """The pipeline drops a file's `revision` because sentence-transformers does: its
    load call's hub arguments (revision None) replace the file's before from_pretrained."""
    st = pytest.importorskip("sentence_transformers")
    import transformers

    transformer(folder, model_args={"revision": "another-branch"})
    seen: list[Any] = []
    original = transformers.AutoModel.from_pretrained.__func__  # type: ignore[attr-defined]

    def spy(cls: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("revision", "absent"))
        return original(cls, *args, **kwargs)

    patch = pytest.MonkeyPatch()
    patch.setattr(transformers.AutoModel, "from_pretrained", classmethod(spy))
    try:
        st.SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    finally:
        patch.undo()
    assert seen == [None]
    assert "revision" not in ModelSpec.read(str(folder)).stack.transformer.kwargs("model_kwargs")


def test_a_second_transformer_or_pooling_is_refused_by_name(folder: Path) -> None:
    add_module(folder, "Pooling", {"embedding_dimension": HIDDEN, "pooling_mode": "cls"})
    message = refusal(folder)
    assert "a second Pooling module" in message
    assert "Dense" not in message


# ------------------------------------------------------------------ widths across the stack


def test_a_pooling_dimension_other_than_the_hidden_size_pools_what_st_pools(
    folder: Path,
) -> None:
    """sentence-transformers pools the transformer's token embeddings whatever the
    Pooling config's dimension says: 384 over a BERT of hidden size 32 gives 32-d
    vectors, and so does the pipeline (it used to crash at its first batch)."""
    from pipeline.model.embedder import Embedder

    pooling(folder, word_embedding_dimension=384)
    spec = ModelSpec.read(str(folder))
    assert spec.dim == HIDDEN
    embedder = Embedder.load(str(folder), "fp32", "cpu")
    try:
        ours = embedder.embed(TEXTS)
    finally:
        embedder.close()
    assert ours.shape == (len(TEXTS), HIDDEN)
    st = pytest.importorskip("sentence_transformers")
    theirs = st.SentenceTransformer(str(folder), device="cpu", local_files_only=True).encode(TEXTS)
    assert theirs.shape == ours.shape
    cosines = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert cosines.min() >= 0.9999


def test_a_module_of_another_width_is_refused_at_start(folder: Path) -> None:
    """A Dense or LayerNorm that does not take the width before it fails in
    sentence-transformers too: refused from the configs, before any weights load."""
    pooling(folder, word_embedding_dimension=384)
    without_normalize(folder)
    add_module(folder, "Dense", {"in_features": 384, "out_features": 16})
    assert "Dense of 384-d input after a 32-d output" in refusal(folder)


def test_a_network_of_another_width_than_the_stack_is_refused_at_load(folder: Path) -> None:
    """Where the stack was read for another width than the loaded network gives (a
    config.json whose hidden size the pipeline does not know), the load refuses in one
    line instead of the first batch failing."""
    import dataclasses

    from pipeline.model import network

    spec = ModelSpec.read(str(folder))
    wrong = dataclasses.replace(spec.stack.pooling, embedding_dimension=384)
    spec = dataclasses.replace(spec, stack=dataclasses.replace(spec.stack, pooling=wrong))
    for choice in ("native", "transformers"):
        with pytest.raises(ModelError, match="gives 32-d token embeddings") as refused:
            network.load(spec, choice)
        assert "\n" not in str(refused.value)
