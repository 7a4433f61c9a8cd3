"""Small random-weight models of many architectures and module stacks, built offline.

Each is saved the way users get models: a Hugging Face transformer and tokenizer,
wrapped by sentence-transformers' own classes (Transformer, Pooling, Dense, ...)
and saved with `SentenceTransformer.save`, or written with the older config
formats by hand where a case is about them. The conformance tests compare the
pipeline's vectors of each with sentence-transformers' `encode`.

Tokenizers: BERT's WordPiece comes from the default model package; a byte-level
BPE and a Unigram are trained here on the stdlib sample corpus (seconds), so
RoBERTa, XLM-R, T5, GPT-2 and Qwen2 folders carry tokenizers of their own kind.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HIDDEN = 32
ST_CONFIG_NAME = "config_sentence_transformers.json"
SEED = 7
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Kafka consumers commit offsets only after the outputs are durable.",
    "向量检索服务把文本编码成稠密向量，再用近似最近邻索引召回。",
    "混合语言 text: Kafka 消费者按 micro-batch 写入 Parquet 和 FAISS。",
    "Crème brûlée, ÉTÉ and naïve façades: ACCENTS and Capitals.",
    "x",
    "  leading and trailing spaces  ",
    "emoji 🚀 and symbols ±∞ ≠ ≤",
    "UPPER CASE ONLY SENTENCE",
    "a [MASK] token and <s> tags in the raw text",
    " ".join(["a long text that every maximum length here cuts"] * 40),
    "Short.",
    "def embed(texts): return model.encode(texts)  # code",
    "2026-11-02T10:15:00Z ERROR [db-3] req=9f2c user=1234 took=12.5ms",
    # Past every limit here (3,000 tokens and more), numbered: the start and the end differ.
    " ".join(f"({i}) part {i} of a text past every limit here." for i in range(300)),
    "".join(f"第{i}段：向量检索服务把文本编码成稠密向量，Crème brûlée。" for i in range(120)),
]


def texts(extra: int = 0) -> list[str]:
    """TEXTS, and `extra` paragraphs of the stdlib sample corpus after them."""
    if not extra:
        return list(TEXTS)
    from pipeline.core.corpus import sample_texts

    return [*TEXTS, *sample_texts(extra)]


@dataclass(frozen=True)
class Case:
    """One model: its transformer (`family`), its modules after the Transformer, and
    what else the folder says."""

    family: str
    modules: tuple[dict[str, Any], ...] = ({"type": "Pooling", "mode": "mean"},)
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt: str | None = None
    truncate_dim: int | None = None
    # Written as sentence-transformers 2.x wrote them: boolean pooling keys and
    # sentence_bert_config.json's max_seq_length / do_lower_case.
    legacy: dict[str, Any] | None = None
    padding_side: str = "right"
    # tokenizer_config.json settings (truncation_side, do_lower_case, strip_accents,
    # tokenize_chinese_chars), as transformers reads them back.
    tokenizer: dict[str, Any] = field(default_factory=dict)
    max_seq_length: int | None = None  # the Transformer module's, where not the tokenizer's
    positions: int = 128  # max_position_embeddings of the BERT family
    plain: bool = False  # no modules.json: a bare Hugging Face folder
    refused: str | None = None  # the words a refusal names, for refused cases


MEAN: dict[str, Any] = {"type": "Pooling", "mode": "mean"}
NORMALIZE: dict[str, Any] = {"type": "Normalize"}
CASES: dict[str, Case] = {
    # -- module stacks, on the native BERT encoder
    "bert-mean-normalize": Case("bert", (MEAN, NORMALIZE)),
    "bert-cls": Case("bert", ({"type": "Pooling", "mode": "cls"},)),
    "bert-max": Case("bert", ({"type": "Pooling", "mode": "max"},)),
    "bert-mean-sqrt": Case("bert", ({"type": "Pooling", "mode": "mean_sqrt_len_tokens"},)),
    "bert-weightedmean": Case("bert", ({"type": "Pooling", "mode": "weightedmean"},)),
    "bert-lasttoken": Case("bert", ({"type": "Pooling", "mode": "lasttoken"},)),
    "bert-cls-mean-max": Case("bert", ({"type": "Pooling", "mode": ("cls", "mean", "max")},)),
    "bert-prompt-excluded": Case(
        "bert",
        ({"type": "Pooling", "mode": "mean", "include_prompt": False}, {"type": "Normalize"}),
        prompts={"query": "query: ", "document": "passage: "},
    ),
    "bert-prompt-excluded-cls": Case(
        "bert",
        ({"type": "Pooling", "mode": ("cls", "lasttoken"), "include_prompt": False},),
        prompts={"document": "represent this document for retrieval: "},
    ),
    "bert-default-prompt": Case(
        "bert", prompts={"classify": "classify: "}, default_prompt="classify"
    ),
    "bert-dense-tanh": Case("bert", (MEAN, {"type": "Dense", "out": 16}, NORMALIZE)),
    "bert-dense-identity-gelu": Case(
        "bert",
        (
            {"type": "Pooling", "mode": "cls"},
            {"type": "Dense", "out": 24, "activation": "Identity"},
            {"type": "Dropout"},
            {"type": "Dense", "out": 12, "activation": "GELU", "bias": False},
            {"type": "Normalize"},
        ),
    ),
    "bert-dense-residual": Case(
        "bert",
        (
            {"type": "Pooling", "mode": "mean"},
            {"type": "Dense", "out": 32, "activation": "ReLU", "residual": True},
            {"type": "Dense", "out": 20, "activation": "SiLU", "residual": True},
        ),
    ),
    "bert-layernorm": Case(
        "bert",
        ({"type": "Pooling", "mode": "max"}, {"type": "LayerNorm"}, {"type": "Normalize"}),
    ),
    "bert-normalize-then-dense": Case(
        "bert",
        ({"type": "Pooling", "mode": "mean"}, {"type": "Normalize"}, {"type": "Dense", "out": 8}),
    ),
    "bert-matryoshka": Case(
        "bert", ({"type": "Pooling", "mode": "mean"}, {"type": "Normalize"}), truncate_dim=12
    ),
    "bert-legacy-cls-max": Case(
        "bert",
        legacy={"pooling": {"pooling_mode_cls_token": True, "pooling_mode_max_tokens": True}},
    ),
    "bert-legacy-lower-case": Case(
        "bert-cased",
        ({"type": "Pooling", "mode": "mean"}, {"type": "Normalize"}),
        legacy={"max_seq_length": 24, "do_lower_case": True},
    ),
    "bert-cased": Case("bert-cased", ({"type": "Pooling", "mode": "cls"},)),
    "bert-plain": Case("bert", plain=True),
    # -- tokenizer settings: each changes the ids, read by the fast path or left to Rust
    "bert-truncate-left": Case("bert", (MEAN, NORMALIZE), tokenizer={"truncation_side": "left"}),
    # Cut at 2,048 tokens, texts of 3,000 and more: the end kept, then the start.
    "bert-truncate-left-2048": Case(
        "bert", (MEAN,), tokenizer={"truncation_side": "left"}, max_seq_length=2048,
        positions=2048,
    ),
    "bert-limit-2048": Case("bert", (MEAN, NORMALIZE), max_seq_length=2048, positions=2048),
    "bert-keep-accents": Case("bert", (MEAN,), tokenizer={"strip_accents": False}),
    "bert-cased-strip-accents": Case(
        "bert-cased", ({"type": "Pooling", "mode": "cls"},), tokenizer={"strip_accents": True}
    ),
    "bert-no-chinese-chars": Case("bert", (MEAN,), tokenizer={"tokenize_chinese_chars": False}),
    "bert-uncased-vocab-cased": Case(
        "bert", ({"type": "Pooling", "mode": "max"},), tokenizer={"do_lower_case": False}
    ),
    "roberta-truncate-left": Case("roberta", (MEAN,), tokenizer={"truncation_side": "left"}),
    # sentence-transformers 1.x/2.x kept the Transformer's files in a folder of its own.
    "bert-transformer-folder": Case("bert", (MEAN, {"type": "Dense", "out": 16})),
    # -- architectures
    "roberta-bpe": Case("roberta", ({"type": "Pooling", "mode": "mean"}, {"type": "Normalize"})),
    "xlm-roberta-unigram": Case("xlm-roberta", ({"type": "Pooling", "mode": "cls"},)),
    "distilbert": Case("distilbert", ({"type": "Pooling", "mode": "mean"}, {"type": "Normalize"})),
    "mpnet": Case("mpnet", ({"type": "Pooling", "mode": "mean"}, {"type": "Normalize"})),
    "electra": Case("electra", ({"type": "Pooling", "mode": "cls"},)),
    "albert": Case("albert", ({"type": "Pooling", "mode": "mean"},)),
    "deberta-v2": Case("deberta-v2", ({"type": "Pooling", "mode": "mean"},)),
    "modernbert": Case("modernbert", ({"type": "Pooling", "mode": "mean"}, {"type": "Normalize"})),
    "nomic-bert": Case("nomic-bert", ({"type": "Pooling", "mode": "mean"}, {"type": "Normalize"})),
    "t5-encoder-dense": Case(
        "t5",
        (
            {"type": "Pooling", "mode": "mean"},
            {"type": "Dense", "out": 32, "activation": "Identity", "bias": False},
            {"type": "Normalize"},
        ),
    ),
    "gpt2-lasttoken": Case("gpt2", ({"type": "Pooling", "mode": "lasttoken"},)),

    "qwen2-lasttoken-left": Case(
        "qwen2",
        ({"type": "Pooling", "mode": "lasttoken"}, {"type": "Normalize"}),
        prompts={"query": "Instruct: find passages\nQuery: ", "document": ""},
        padding_side="left",
    ),
    "llama-mean": Case("llama", ({"type": "Pooling", "mode": "mean"},)),
    "qwen2-plain": Case("qwen2", plain=True, padding_side="left"),
    # -- refused: the pipeline does not reproduce these
    "refused-weighted-layer-pooling": Case(
        "bert", ({"type": "WeightedLayerPooling"},), refused="WeightedLayerPooling"
    ),
    "refused-custom-module": Case(
        "bert", ({"type": "Pooling", "mode": "mean"}, {"type": "custom"}), refused="my_package"
    ),
    "refused-dense-bin": Case(
        "bert", ({"type": "Pooling", "mode": "mean"}, {"type": "Dense", "out": 8, "bin": True}),
        refused="pytorch_model.bin",
    ),
    "refused-activation": Case(
        "bert",
        ({"type": "Pooling", "mode": "mean"}, {"type": "Dense", "out": 8, "activation": "my.Act"}),
        refused="activation",
    ),
    "refused-message-modality": Case("bert", refused="modality_config"),
    "refused-sparse-encoder": Case("bert", refused="SparseEncoder"),
    "refused-remote-code": Case("bert", plain=True, refused="trust_remote_code"),
    # Absolute positions, padded on the left by sentence-transformers: its vectors
    # depend on the batch, so there is none to equal.
    "refused-gpt2-left-padding": Case(
        "gpt2", ({"type": "Pooling", "mode": "weightedmean"},), padding_side="left",
        refused="pads it on the left",
    ),
}  # fmt: skip

ACCEPTED = [name for name, case in CASES.items() if case.refused is None]
REFUSED = [name for name, case in CASES.items() if case.refused is not None]


def build(name: str, root: Path) -> Path:
    """The folder of CASES[name] under `root` (built once)."""
    folder = root / name
    if (folder / ".built").is_file():
        return folder
    if folder.exists():
        shutil.rmtree(folder)
    case = CASES[name]
    transformer = _transformer(case, root)
    if case.plain:
        shutil.copytree(transformer, folder)
    else:
        _sentence_transformer(case, transformer, folder)
    _damage_for_refusal(name, folder)
    _set_tokenizer_config(folder, case)
    if name == "bert-transformer-folder":
        _transformer_into_its_folder(folder)
    (folder / ".built").write_text("1\n")
    return folder


def _transformer_into_its_folder(folder: Path) -> None:
    inner = folder / "0_Transformer"
    inner.mkdir()
    for file in list(folder.iterdir()):
        if file.is_file() and file.name not in ("modules.json", ST_CONFIG_NAME, "README.md"):
            file.rename(inner / file.name)
    modules = _modules(folder)
    modules[0]["path"] = "0_Transformer"
    (folder / "modules.json").write_text(json.dumps(modules))


def _set_tokenizer_config(folder: Path, case: Case) -> None:
    """transformers 5 saves no padding_side: written as folders such as
    Qwen3-Embedding's carry it, where it is read back; so are the case's other
    tokenizer settings."""
    settings = {**({"padding_side": "left"} if case.padding_side == "left" else {})}
    settings.update(case.tokenizer)
    if not settings:
        return
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(settings)
    path.write_text(json.dumps(config, indent=2))


# ------------------------------------------------------------------ tokenizers


def _bert_tokenizer(cased: bool) -> Any:
    from transformers import AutoTokenizer

    from pipeline.model.spec import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path("default")[1]))
    if cased:
        tokenizer = type(tokenizer)(vocab=tokenizer.get_vocab(), do_lower_case=False)
    tokenizer.model_max_length = 128
    return tokenizer


def _training_texts() -> list[str]:
    from pipeline.core.corpus import sample_texts

    return [*sample_texts(300), *TEXTS * 10]


def _bpe(kind: str) -> Any:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_training_texts(), trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab, merges = model["vocab"], [tuple(m) for m in model["merges"]]
    cls = getattr(transformers, kind)
    if kind == "GPT2Tokenizer":
        made = cls(vocab=vocab, merges=merges, unk_token="<unk>", bos_token="<s>",
                   eos_token="</s>", pad_token="<pad>", add_bos_token=True)  # fmt: skip
    else:
        made = cls(vocab=vocab, merges=merges)
    made.model_max_length = 128
    return made


def _unigram(kind: str) -> Any:
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=700, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        unk_token="<unk>",
    )  # fmt: skip
    tokenizer.train_from_iterator(_training_texts(), trainer)
    vocab = [tuple(piece) for piece in json.loads(tokenizer.to_str())["model"]["vocab"]]
    made = getattr(transformers, kind)(vocab=vocab)
    made.model_max_length = 128
    return made


# ------------------------------------------------------------------ transformers


def _config(family: str, tokenizer: Any, positions: int = 128) -> Any:
    import transformers as t

    vocab, pad = len(tokenizer), tokenizer.pad_token_id
    common = {"vocab_size": vocab, "pad_token_id": pad}
    bert_like = {
        "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": positions, **common,
    }  # fmt: skip
    offset = {**bert_like, "max_position_embeddings": positions + pad + 1}
    decoder = {
        "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 64, "max_position_embeddings": 128,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        **common,
    }  # fmt: skip
    factories: dict[str, Callable[[], Any]] = {
        "bert": lambda: t.BertConfig(**bert_like),
        "bert-cased": lambda: t.BertConfig(**bert_like),
        "roberta": lambda: t.RobertaConfig(**offset, bos_token_id=0, eos_token_id=2),
        "xlm-roberta": lambda: t.XLMRobertaConfig(**offset, bos_token_id=0, eos_token_id=2),
        "distilbert": lambda: t.DistilBertConfig(
            dim=HIDDEN, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=128,
            **common,
        ),
        # MPNet counts positions from its fixed padding index 1, whatever pad_token_id is.
        "mpnet": lambda: t.MPNetConfig(**{**offset, "max_position_embeddings": 130}),
        "electra": lambda: t.ElectraConfig(**bert_like, embedding_size=16),
        "albert": lambda: t.AlbertConfig(**bert_like, embedding_size=16),
        "deberta-v2": lambda: t.DebertaV2Config(
            **bert_like, relative_attention=True, pos_att_type=["p2c", "c2p"],
            position_buckets=16, max_relative_positions=64,
        ),
        "modernbert": lambda: t.ModernBertConfig(
            vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=128, local_attention=16,
            pad_token_id=pad, bos_token_id=tokenizer.cls_token_id,
            eos_token_id=tokenizer.sep_token_id, cls_token_id=tokenizer.cls_token_id,
            sep_token_id=tokenizer.sep_token_id,
        ),
        "nomic-bert": lambda: t.NomicBertConfig(**bert_like),
        "t5": lambda: t.T5Config(
            vocab_size=vocab, d_model=HIDDEN, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
            pad_token_id=pad, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=pad,
        ),
        "gpt2": lambda: t.GPT2Config(
            vocab_size=vocab, n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=128,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad,
        ),
        "qwen2": lambda: t.Qwen2Config(**decoder),
        "llama": lambda: t.LlamaConfig(**decoder),
    }  # fmt: skip
    return factories[family]()


TOKENIZERS: dict[str, Callable[[], Any]] = {
    "bert": lambda: _bert_tokenizer(cased=False),
    "bert-cased": lambda: _bert_tokenizer(cased=True),
    "roberta": lambda: _bpe("RobertaTokenizer"),
    "xlm-roberta": lambda: _unigram("XLMRobertaTokenizer"),
    "t5": lambda: _unigram("T5Tokenizer"),
    "gpt2": lambda: _bpe("GPT2Tokenizer"),
    "qwen2": lambda: _bpe("RobertaTokenizer"),
    "llama": lambda: _bpe("RobertaTokenizer"),
}


def _transformer(case: Case, root: Path) -> Path:
    """The Hugging Face folder of the case's family and padding side (shared by cases)."""
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    settings = "".join(f"-{k}={v}" for k, v in sorted(case.tokenizer.items()))
    folder = root / f"_hf-{case.family}-{case.padding_side}-{case.positions}{settings}"
    if (folder / ".built").is_file():
        return folder
    tokenizer = TOKENIZERS.get(case.family, TOKENIZERS["bert"])()
    tokenizer.padding_side = case.padding_side
    config = _config(case.family, tokenizer, case.positions)
    torch.manual_seed(SEED)
    if case.family == "t5":
        model = transformers.T5EncoderModel(config)
    elif case.family in ("gpt2", "qwen2", "llama"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        model = transformers.AutoModel.from_config(config)
    _randomize_norms(model)
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    _set_tokenizer_config(folder, case)
    (folder / ".built").write_text("1\n")
    return folder


def _randomize_norms(model: Any) -> None:
    """Layer norms start at ones and zeros: random ones make a wrong order of
    operations show in the vectors."""
    import torch

    generator = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name.lower() or "ln_" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)


# ------------------------------------------------------------------ sentence-transformers


def _sentence_transformer(case: Case, transformer: Path, folder: Path) -> None:
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Dropout, LayerNorm, Pooling

    torch.manual_seed(SEED + 2)
    legacy = case.legacy or {}
    modules: list[Any] = [Transformer(str(transformer), max_seq_length=case.max_seq_length)]
    dim = HIDDEN
    custom: list[int] = []
    for index, spec in enumerate(case.modules, start=1):
        kind = spec["type"]
        if kind == "Pooling":
            modes = spec["mode"]
            modules.append(Pooling(HIDDEN, modes, spec.get("include_prompt", True)))
            dim = HIDDEN * (1 if isinstance(modes, str) else len(modes))
        elif kind == "Dense":
            activation = getattr(torch.nn, spec.get("activation", "Tanh"), torch.nn.Tanh)()
            modules.append(
                Dense(dim, spec["out"], bias=spec.get("bias", True), activation_function=activation,
                      use_residual=spec.get("residual", False))
            )  # fmt: skip
            dim = spec["out"]
        elif kind == "LayerNorm":
            norm = LayerNorm(dim)
            with torch.no_grad():
                norm.norm.weight.add_(torch.randn(dim) * 0.2)
                norm.norm.bias.add_(torch.randn(dim) * 0.2)
            modules.append(norm)
        elif kind == "Normalize":
            modules.append(Normalize())
        elif kind == "Dropout":
            modules.append(Dropout(0.3))
        else:  # WeightedLayerPooling, custom: a Pooling stands in, renamed after saving
            modules.append(Pooling(HIDDEN, "mean"))
            custom.append(index)
    if len(modules) == 1:
        modules.append(Pooling(HIDDEN, "mean"))
    model = SentenceTransformer(
        modules=modules,
        prompts=case.prompts or None,
        default_prompt_name=case.default_prompt,
        truncate_dim=case.truncate_dim,
        device="cpu",
    )
    model.save(str(folder))
    if legacy:
        _write_legacy(folder, legacy)
    for index in custom:
        _rename_module(folder, index, case.modules[index - 1]["type"])
    for index, spec in enumerate(case.modules, start=1):
        if spec.get("activation") == "my.Act":
            _edit_module_config(folder, index, {"activation_function": "my.Act"})
        if spec.get("bin"):
            module_dir = _module_dir(folder, index)
            weights = module_dir / "model.safetensors"
            from safetensors.torch import load_file

            torch.save(load_file(str(weights)), module_dir / "pytorch_model.bin")
            weights.unlink()


def _modules(folder: Path) -> list[dict[str, Any]]:
    return json.loads((folder / "modules.json").read_text())


def _module_dir(folder: Path, index: int) -> Path:
    return folder / _modules(folder)[index]["path"]


def _edit_module_config(folder: Path, index: int, changes: dict[str, Any]) -> None:
    path = _module_dir(folder, index) / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _rename_module(folder: Path, index: int, kind: str) -> None:
    modules = _modules(folder)
    if kind == "WeightedLayerPooling":
        modules[index]["type"] = (
            "sentence_transformers.sentence_transformer.modules.weighted_layer_pooling."
            "WeightedLayerPooling"
        )
    else:
        modules[index]["type"] = "my_package.modules.Custom"
    (folder / "modules.json").write_text(json.dumps(modules))


def _write_legacy(folder: Path, legacy: dict[str, Any]) -> None:
    if "pooling" in legacy:
        pooling = _module_dir(folder, 1) / "config.json"
        pooling.write_text(json.dumps({"word_embedding_dimension": HIDDEN, **legacy["pooling"]}))
    settings = {k: legacy[k] for k in ("max_seq_length", "do_lower_case") if k in legacy}
    if settings:
        (folder / "sentence_bert_config.json").write_text(json.dumps(settings))


def _damage_for_refusal(name: str, folder: Path) -> None:
    """The refusals that are about a folder's files, not its modules."""
    if name == "refused-message-modality":
        path = folder / "sentence_bert_config.json"
        config = json.loads(path.read_text())
        config["modality_config"] = {"message": {"method": "forward", "method_output_name": "x"}}
        path.write_text(json.dumps(config))
    elif name == "refused-sparse-encoder":
        path = folder / "config_sentence_transformers.json"
        config = json.loads(path.read_text())
        config["model_type"] = "SparseEncoder"
        path.write_text(json.dumps(config))
    elif name == "refused-remote-code":
        path = folder / "config.json"
        config = json.loads(path.read_text())
        config["model_type"] = "my-remote-bert"
        config["auto_map"] = {"AutoModel": "modeling_mine.MyModel"}
        path.write_text(json.dumps(config))
