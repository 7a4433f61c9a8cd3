"""pipeline.model.bert against transformers: the same token ids and last hidden states on
the real default model, the tiny random BERT and random RoBERTa/XLM-R folders; the
embedder on it at fp32, bf16 and int8 (OpenVINO); start-up without importing transformers;
and the fallback to transformers where a folder is not one it runs."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.core.corpus import sample_texts
from pipeline.core.errors import ModelError
from pipeline.model import bert
from pipeline.model.embedder import Embedder, Tokenized, activation_bytes_per_token
from pipeline.model.spec import resolve_model_path

REPO = Path(__file__).resolve().parents[1]
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# Beyond the vocabulary's scripts (CJK characters are split one per token, most of
# them [UNK]), accents, emoji and mixed scripts: the tokenizers must agree on all.
FOREIGN = [
    "这是一个用来测试的中文句子，里面有标点符号。",
    "混合 English 和中文 text, 日本語も少し, и немного русского.",
    "Ünïcödé àccénts, ligatures ﬁ ﬂ, and emoji 😀🚀 in one line",
    "한국어 문장과 العربية والعبرية עברית together",
    "   leading and trailing spaces, tabs\tand\nnewlines   ",
    "[CLS] a literal [SEP] inside [PAD] the text [MASK]",
]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Mixed lengths (a long one truncated at the limit) and foreign scripts."""
    sample = sample_texts(200)
    return [sample[0][:20], *FOREIGN, *sample[1:9], " ".join(sample[10:40]), "x"]


@pytest.fixture(scope="module")
def default_path() -> Path:
    return resolve_model_path("default")[1]


@pytest.fixture(scope="module", params=["default", "tiny"])
def model_path(request: pytest.FixtureRequest, default_path: Path) -> Path:
    if request.param == "default":
        return default_path
    return Path(request.getfixturevalue("tiny_model"))


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids, mask


def reference(path: Path) -> Any:
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(path), use_safetensors=True).eval()


# ------------------------------------------------------------------ tokenizer


def test_the_resolved_tokenizer_is_autotokenizers(model_path: Path, texts: list[str]) -> None:
    """The tokenizer the pipeline runs is the one transformers builds from the folder,
    read back from the metadata cache without transformers."""
    from transformers import AutoTokenizer

    from pipeline.model.spec import ModelSpec
    from pipeline.model.tokenize import resolve as resolved_tokenizers

    spec = ModelSpec.read(str(model_path))
    theirs = AutoTokenizer.from_pretrained(str(model_path))
    assert spec.tokenizer.pad_token_id == theirs.pad_token_id
    ids = [e.ids for e in spec.tokenizer.backend(128).encode_batch(texts)]
    assert ids == theirs(texts, truncation=True, max_length=128)["input_ids"]
    assert any(theirs.unk_token_id in row for row in ids)  # the CJK rows: mostly [UNK]
    again = resolved_tokenizers.resolve(spec.stack.transformer, 512)
    assert again == spec.tokenizer


def test_a_cached_tokenizer_needs_no_transformers(tiny_model: str) -> None:
    code = (
        "import sys\n"
        "from pipeline.model.spec import ModelSpec\n"
        f"spec = ModelSpec.read({tiny_model!r})\n"
        "print('transformers' in sys.modules)\n"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True, text=True, cwd=REPO, env={**os.environ, **OFFLINE}, timeout=300,
        )
        for _ in range(2)
    ]  # fmt: skip
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr
    assert runs[1].stdout.strip() == "False"  # the second read the cache


def test_tokenizer_limits_as_sentence_transformers_reads_them(
    tiny_model: str, tmp_path: Path
) -> None:
    """No model_max_length: the position limit (sentence-transformers caps the
    tokenizer's with max_position_embeddings) unless sentence_bert_config.json names
    one; a pad token named in special_tokens_map.json wins over the config's, as in
    transformers."""
    from transformers import AutoTokenizer

    folder = copy_model(Path(tiny_model), tmp_path / "m")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["model_max_length"]
    config["pad_token"] = "[MASK]"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    theirs = AutoTokenizer.from_pretrained(str(folder))
    embedder = Embedder.load(str(folder))
    assert embedder.spec.tokenizer.pad_token_id == theirs.pad_token_id
    assert embedder.info.max_length == 128  # sentence_bert_config.json's
    (folder / "sentence_bert_config.json").write_text("{}")
    assert Embedder.load(str(folder)).info.max_length == 512  # the positions'


# ------------------------------------------------------------------ hidden states


def test_last_hidden_state_matches_transformers(model_path: Path, texts: list[str]) -> None:
    from pipeline.model.spec import ModelSpec

    tokenizer = ModelSpec.read(str(model_path)).tokenizer.backend(256)
    rows = [e.ids for e in tokenizer.encode_batch(texts)]
    ids, mask = padded(rows, 0)
    assert (mask == 0).any()  # padding present
    ours, theirs = bert.load_encoder(model_path), reference(model_path)
    with torch.inference_mode():
        expected = theirs(input_ids=ids, attention_mask=mask).last_hidden_state
        got = ours(ids, mask)
        assert got.shape == expected.shape == (len(rows), ids.shape[1], ours.config.hidden_size)
        assert (got - expected).abs().max().item() < 1e-4
        # no padding at all: no mask on our side, an all-ones one on theirs
        same = ids[:, :6]
        expected = theirs(input_ids=same, attention_mask=torch.ones_like(same)).last_hidden_state
        assert (ours(same, None) - expected).abs().max().item() < 1e-4


def random_folder(kind: str, directory: Path, **config: Any) -> Path:
    """A random BERT-family model saved by transformers (safetensors), no tokenizer."""
    import transformers

    torch.manual_seed(7)
    classes = {
        "bert": ("BertConfig", "BertModel"),
        "bert-mlm": ("BertConfig", "BertForMaskedLM"),  # keys prefixed "bert."
        "roberta": ("RobertaConfig", "RobertaModel"),
        "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel"),
    }
    config_class, model_class = (getattr(transformers, name) for name in classes[kind])
    shape = dict(
        vocab_size=120,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
    )
    if kind in ("roberta", "xlm-roberta"):
        shape.update(pad_token_id=1, type_vocab_size=1)
    model = model_class(config_class(**{**shape, **config})).eval()
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory


@pytest.mark.parametrize(
    ("kind", "config"),
    [
        ("roberta", {}),
        ("xlm-roberta", {}),
        ("bert-mlm", {}),
        ("bert", {"hidden_act": "gelu_new"}),
        ("bert", {"hidden_act": "relu", "layer_norm_eps": 1e-5}),
    ],
)
def test_family_members_match_transformers(
    kind: str, config: dict[str, Any], tmp_path: Path
) -> None:
    """RoBERTa/XLM-R positions count from padding_idx + 1 over real tokens only; a task
    head's "bert." prefix is dropped; other activations and epsilons are honoured."""
    folder = random_folder(kind, tmp_path / kind, **config)
    ours, theirs = bert.load_encoder(folder), reference(folder)
    pad = ours.config.pad_token_id
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(5, 120, (n,), generator=generator).tolist() for n in (9, 3, 17, 1)]
    ids, mask = padded(rows, pad)
    with torch.inference_mode():
        expected = theirs(input_ids=ids, attention_mask=mask).last_hidden_state
        assert (ours(ids, mask) - expected).abs().max().item() < 1e-5
        if kind in ("roberta", "xlm-roberta"):  # positions really do start at pad + 1
            expected = theirs(input_ids=ids[:1, :9], attention_mask=mask[:1, :9])
            assert (ours(ids[:1, :9]) - expected.last_hidden_state).abs().max().item() < 1e-5


# ------------------------------------------------------------------ the embedder


@pytest.fixture(scope="module")
def loaded() -> Iterator[dict[tuple[str, str, str], Embedder]]:
    """Embedders by (model, precision, encoder), loaded once per module."""
    cache: dict[tuple[str, str, str], Embedder] = {}
    yield cache
    for embedder in cache.values():
        embedder.close()


def embedder_for(
    cache: dict[tuple[str, str, str], Embedder], path: Path, precision: str, encoder: str
) -> Embedder:
    key = (str(path), precision, encoder)
    if key not in cache:
        cache[key] = Embedder.load(str(path), precision, "cpu", encoder=encoder)
    return cache[key]


def test_embeddings_match_transformers_fp32(
    model_path: Path, texts: list[str], loaded: dict
) -> None:
    native = embedder_for(loaded, model_path, "fp32", "native")
    hf = embedder_for(loaded, model_path, "fp32", "transformers")
    assert isinstance(native._model, bert.BertEncoder)
    assert not isinstance(hf._model, bert.BertEncoder)
    assert native.info == hf.info
    assert activation_bytes_per_token(native._model) == activation_bytes_per_token(hf._model)
    tokens = native.tokenize(texts)
    assert tokens.lengths.min() < tokens.lengths.max()  # mixed lengths: padded passes
    assert np.array_equal(tokens.lengths, hf.tokenize(texts).lengths)
    ours, theirs = native.embed(texts), hf.embed(texts)
    assert cosines(ours, theirs).min() >= 0.99999
    assert np.abs(ours - theirs).max() < 1e-5


def test_pass_without_padding_runs_unmasked(
    model_path: Path, loaded: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    native = embedder_for(loaded, model_path, "fp32", "native")
    hf = embedder_for(loaded, model_path, "fp32", "transformers")
    rng = np.random.default_rng(1)
    rows = [[101, *rng.integers(2000, 20000, 14).tolist(), 102] for _ in range(6)]
    tokens = Tokenized(rows, np.full(6, 16, dtype=np.int64), 0)
    masks: list[Any] = []
    model = native._model

    def spy(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Any:
        masks.append(attention_mask)
        return model(input_ids, attention_mask)

    monkeypatch.setattr(native, "_model", spy)
    ours, stats = native.embed_tokens(tokens)
    assert stats.forward_passes >= 1 and all(m is None for m in masks)
    theirs, _ = hf.embed_tokens(tokens)
    assert cosines(ours, theirs).min() >= 0.99999


def _mappings_kb(path: Path) -> dict[str, list[int]]:
    """This process's mappings of `path`, from /proc/self/smaps: address -> [resident, size] kB."""
    found: dict[str, list[int]] = {}
    current: list[int] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header
            current = None
            if len(fields) > 5 and fields[5] == str(path.resolve()):
                current = found.setdefault(fields[0], [0, 0])
        elif current is not None and fields[0] in ("Rss:", "Size:"):
            current[fields[0] == "Size:"] += int(fields[1])
    return found


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="needs Linux /proc")
def test_memory_mapped_weights_are_resident_from_the_start(default_path: Path) -> None:
    """A worker's RSS must not creep up as new token ids touch new pages of the
    word-embedding table: every page of the weights is read at load."""
    weights = default_path / "model.safetensors"
    before = _mappings_kb(weights)
    tensors = bert.read_tensors(default_path, bert.read_config(default_path))
    new = [kb for address, kb in _mappings_kb(weights).items() if address not in before]
    if not new:
        pytest.skip("this safetensors copies the weights instead of mapping the file")
    resident, size = sum(kb[0] for kb in new), sum(kb[1] for kb in new)
    assert resident >= 0.98 * size, f"{resident} of {size} kB resident"
    assert tensors  # held until here: the mapping lives as long as its tensors


def test_bf16_close_to_fp32(default_path: Path, texts: list[str], loaded: dict) -> None:
    fp32 = embedder_for(loaded, default_path, "fp32", "transformers").embed(texts)
    native = embedder_for(loaded, default_path, "bf16", "native")
    assert native._model.embeddings.word_embeddings.weight.dtype == torch.bfloat16
    ours = native.embed(texts)
    assert ours.dtype == np.float32
    assert cosines(ours, fp32).min() >= 0.999
    theirs = embedder_for(loaded, default_path, "bf16", "transformers").embed(texts)
    assert cosines(ours, theirs).min() >= 0.999


def test_int8_from_either_encoder_is_the_same_openvino_model(
    default_path: Path, texts: list[str], loaded: dict
) -> None:
    """int8 runs on OpenVINO converted from the network that loaded: ours or
    transformers'. Both stay within the gate of fp32, and close to each other."""
    fp32 = embedder_for(loaded, default_path, "fp32", "transformers").embed(texts)
    native = embedder_for(loaded, default_path, "int8", "native")
    assert native.engine == "openvino"
    ours = native.embed(texts)
    theirs = embedder_for(loaded, default_path, "int8", "transformers").embed(texts)
    assert cosines(ours, fp32).mean() >= 0.995
    assert cosines(theirs, fp32).mean() >= 0.995
    assert cosines(ours, theirs).min() >= 0.99


# ------------------------------------------------------------------ start-up


def test_default_model_loads_without_transformers() -> None:
    """The point of pipeline.model.bert: transformers (and the torch._dynamo and
    torch.distributed.tensor its modeling code imports) stay out of start-up, once
    the model's tokenizer is resolved (pipeline.model.tokenize.resolve: the first start)."""
    from pipeline.model.spec import ModelSpec

    ModelSpec.read("default")
    code = (
        "import sys\n"
        "from pipeline.model.embedder import Embedder\n"
        "e = Embedder.load('default')\n"
        "assert e.embed(['hello world', '你好']).shape == (2, 384)\n"
        "heavy = ('transformers', 'sentence_transformers', 'torch._dynamo')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PIPELINE_ENCODER"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**env, **OFFLINE},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ------------------------------------------------------------------ fallback


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def rewrite_weights(folder: Path, change: Any) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    save_file(change(tensors), str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_a_missing_tensor_is_refused_by_both_encoders(
    tiny_model: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """transformers would initialise a missing weight at random: vectors no other load
    (sentence-transformers' included) gives. The native encoder says what is missing
    and leaves it to transformers, which refuses it."""
    folder = copy_model(Path(tiny_model), tmp_path / "m")
    gone = "encoder.layer.1.output.dense.bias"
    rewrite_weights(folder, lambda t: {k: v for k, v in t.items() if k != gone})
    with (
        caplog.at_level(logging.WARNING, logger="pipeline.model.network"),
        pytest.raises(ModelError, match=f"weights lack {gone}.*at random"),
    ):
        Embedder.load(str(folder), encoder="auto")
    assert any(gone in r.getMessage() for r in caplog.records)
    with pytest.raises(ModelError, match=f"the native encoder cannot run .*{gone}"):
        Embedder.load(str(folder), encoder="native")


def test_wrong_shape_is_incomplete(tiny_model: str, tmp_path: Path) -> None:
    folder = copy_model(Path(tiny_model), tmp_path / "m")
    name = "encoder.layer.0.intermediate.dense.weight"
    rewrite_weights(folder, lambda t: {**t, name: t[name][:32].contiguous()})
    with pytest.raises(bert.Incomplete, match=f"{name} \\(32, 32\\) \\(config: \\(64, 32\\)\\)"):
        bert.load_encoder(folder)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"model_type": "distilbert"}, "model_type 'distilbert' has no native encoder"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ({"hidden_act": "quick_gelu"}, "hidden_act 'quick_gelu'"),
        ({"is_decoder": True}, "decoder"),
    ],
)
def test_configs_it_does_not_run(
    tiny_model: str, tmp_path: Path, change: dict[str, Any], reason: str
) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(bert.Unsupported, match=reason) as raised:
        bert.read_config(folder)
    assert not isinstance(raised.value, bert.Incomplete)


def test_encoder_choice(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PIPELINE_ENCODER", "transformers")
    with caplog.at_level(logging.INFO, logger="pipeline"):
        forced = Embedder.load(tiny_model)
    assert not isinstance(forced._model, bert.BertEncoder)
    assert any("transformers" in r.getMessage() for r in caplog.records)
    forced.close()
    monkeypatch.setenv("PIPELINE_ENCODER", "onnx")
    with pytest.raises(ModelError, match="PIPELINE_ENCODER='onnx' is not one of auto, native"):
        Embedder.load(tiny_model)
    monkeypatch.delenv("PIPELINE_ENCODER")
    native = Embedder.load(tiny_model)
    assert isinstance(native._model, bert.BertEncoder)
    native.close()


def test_damaged_weights_are_a_model_error(tiny_model: str, tmp_path: Path) -> None:
    folder = copy_model(Path(tiny_model), tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelError, match="cannot load model from"):
        Embedder.load(str(folder))
