"""A model folder's sentence-transformers module stack, read from its configs alone.

sentence-transformers runs a model as a chain of modules listed in `modules.json`,
each with a config in its folder: the Transformer (a Hugging Face model and its
tokenizer), then Pooling, then any of Dense, LayerNorm, Dropout and Normalize.
`read_stack` reads that chain into frozen values, as sentence-transformers 3 to 6
read it (old and new config formats alike), and refuses, with one line naming it
(ModelError, exit 72), every module type or option the pipeline does not
reproduce: a model either gives the vectors its authors intended or does not start.

A folder without `modules.json` is a plain Hugging Face model: sentence-transformers
gives it mean pooling, or last-token pooling when its architecture is a causal LM,
and so does this module. Nothing here imports torch or reads weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.errors import ModelError

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# The legacy boolean keys, in the order sentence-transformers concatenates their modes.
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
SUPPORTED_MODULES = ("Transformer", "Pooling", "Dense", "LayerNorm", "Dropout", "Normalize")
# sentence-transformers reads the Transformer's config under any of these names.
TRANSFORMER_CONFIGS = (
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)
ST_CONFIG = "config_sentence_transformers.json"
# Transformer config keys whose values change no vector (or that are checked below).
_TEXT_MODALITY = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
# model_kwargs sentence-transformers passes to from_pretrained that change no value
# the pipeline computes: the dtype is the pipeline's --precision, attention kernels
# compute the same function.
_MODEL_KWARGS_IGNORED = {"torch_dtype", "dtype", "attn_implementation", "device_map"}
_HUB_KWARGS = {"trust_remote_code", "revision", "token", "cache_dir", "local_files_only"}
_IDENTITY_MODULE = "torch.nn.modules.linear.Identity"
_TANH = "torch.nn.modules.activation.Tanh"


@dataclass(frozen=True)
class TransformerModule:
    """The Transformer module: where the Hugging Face model is and how it is called."""

    directory: Path
    max_seq_length: int | None = None
    do_lower_case: bool = False
    # Passed to from_pretrained as sentence-transformers passes them (JSON, sorted).
    processor_kwargs: str = "{}"
    model_kwargs: str = "{}"
    config_kwargs: str = "{}"

    def kwargs(self, which: str) -> dict[str, Any]:
        return dict(json.loads(getattr(self, which)))


@dataclass(frozen=True)
class Pooling:
    modes: tuple[str, ...]
    include_prompt: bool = True
    embedding_dimension: int = 0

    @property
    def label(self) -> str:
        return "+".join(self.modes)

    @property
    def output_dimension(self) -> int:
        return len(self.modes) * self.embedding_dimension


@dataclass(frozen=True)
class Dense:
    directory: Path
    in_features: int
    out_features: int
    bias: bool = True
    activation: str = _TANH  # a torch.nn module class, by its dotted path
    residual: bool = False

    @property
    def label(self) -> str:
        extra = ", residual" if self.residual else ""
        activation = self.activation.rsplit(".", 1)[-1]
        return f"Dense({self.in_features}->{self.out_features}, {activation}{extra})"


@dataclass(frozen=True)
class LayerNorm:
    directory: Path
    dimension: int

    @property
    def label(self) -> str:
        return f"LayerNorm({self.dimension})"


@dataclass(frozen=True)
class Normalize:
    label: str = "Normalize"


HeadModule = Dense | LayerNorm | Normalize


@dataclass(frozen=True)
class ModuleStack:
    """What sentence-transformers would run on this folder, in order."""

    transformer: TransformerModule
    pooling: Pooling
    head: tuple[HeadModule, ...] = ()
    # The model's own Matryoshka truncation (config_sentence_transformers.json).
    truncate_dim: int | None = None
    # Where the stack came from: modules.json, or sentence-transformers' defaults.
    declared: bool = field(default=True, compare=False)

    @property
    def normalized(self) -> bool:
        """Whether the stack's output is L2-normalised (its last module is Normalize)."""
        return bool(self.head) and isinstance(self.head[-1], Normalize)

    @property
    def output_dimension(self) -> int:
        dim = self.pooling.output_dimension
        for module in self.head:
            if isinstance(module, Dense):
                dim = module.out_features
        return dim

    def describe(self) -> str:
        parts = [
            "Transformer",
            f"Pooling({self.pooling.label}"
            + ("" if self.pooling.include_prompt else ", prompt excluded")
            + ")",
        ]
        parts += [module.label for module in self.head]
        return " > ".join(parts)


def read_stack(path: Path, config: dict[str, Any]) -> ModuleStack:
    """The module stack of the folder at `path` (`config`: its config.json)."""
    st_config = _json_object(path / ST_CONFIG)
    kind = st_config.get("model_type", "SentenceTransformer")
    if kind != "SentenceTransformer":
        raise ModelError(
            f"model {path} is a sentence-transformers {kind}, not a SentenceTransformer "
            "(dense embeddings): the pipeline does not run it"
        )
    truncate_dim = st_config.get("truncate_dim")
    if truncate_dim is not None and (not isinstance(truncate_dim, int) or truncate_dim < 1):
        raise ModelError(f"{path / ST_CONFIG}: truncate_dim {truncate_dim!r} is not a dimension")
    modules = _read_json(path / "modules.json")
    if modules is None:
        return _default_stack(path, config, truncate_dim)
    if not isinstance(modules, list) or not modules:
        raise ModelError(f"{path / 'modules.json'} lists no modules")
    kinds = [_module_kind(path, entry) for entry in modules]
    if kinds[:2] != ["Transformer", "Pooling"]:
        raise ModelError(
            f"model {path}: module stack {' > '.join(kinds)} does not start with Transformer, "
            "then Pooling: the pipeline does not reproduce it"
        )
    transformer = _transformer(path / _module_path(modules[0]))
    pooling = _pooling(path / _module_path(modules[1]))
    head: list[HeadModule] = []
    dim = pooling.output_dimension
    for entry, kind in zip(modules[2:], kinds[2:], strict=True):
        folder = path / _module_path(entry)
        module = _head_module(kind, folder, dim)
        if module is None:
            continue  # Dropout: nothing at inference
        if isinstance(module, Dense):
            dim = module.out_features
        head.append(module)
    return ModuleStack(transformer, pooling, tuple(head), truncate_dim)


def hidden_size(config: dict[str, Any]) -> int | None:
    """The width of the model's last hidden state, under the names configs use."""
    for source in (config, config.get("text_config") or {}):
        for key in ("hidden_size", "d_model", "n_embd", "dim", "embed_dim"):
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def is_causal_lm(config: dict[str, Any]) -> bool:
    """sentence-transformers' test for last-token pooling by default."""
    architectures = config.get("architectures") or []
    return bool(
        architectures
        and str(architectures[0]).endswith("ForCausalLM")
        and config.get("is_causal", True)
    )


def _default_stack(path: Path, config: dict[str, Any], truncate_dim: int | None) -> ModuleStack:
    width = hidden_size(config)
    if width is None:
        raise ModelError(f"{path / 'config.json'} names no hidden size: cannot pool its output")
    mode = "lasttoken" if is_causal_lm(config) else "mean"
    return ModuleStack(
        TransformerModule(path), Pooling((mode,), True, width), (), truncate_dim, declared=False
    )


def _module_kind(path: Path, entry: Any) -> str:
    if not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
        raise ModelError(f"{path / 'modules.json'}: {entry!r} is not a module entry")
    kind: str = entry["type"]
    name = kind.rsplit(".", 1)[-1]
    if not kind.startswith("sentence_transformers.") or name not in SUPPORTED_MODULES:
        raise ModelError(
            f"model {path}: module {kind} is not one the pipeline reproduces "
            f"({', '.join(SUPPORTED_MODULES)}); refusing it rather than writing vectors that "
            "differ from sentence-transformers'"
        )
    return name


def _module_path(entry: dict[str, Any]) -> str:
    relative = str(entry.get("path", ""))
    if relative.startswith(("/", "\\")) or ".." in Path(relative).parts:
        raise ModelError(f"modules.json: module path {relative!r} leaves the model folder")
    return relative


def _transformer(folder: Path) -> TransformerModule:
    config: dict[str, Any] = {}
    for name in TRANSFORMER_CONFIGS:
        found = _json_object(folder / name)
        if found:
            config = found
            break
    where = folder / TRANSFORMER_CONFIGS[0]
    _expect(config, "transformer_task", "feature-extraction", where)
    _expect(config, "module_output_name", "token_embeddings", where)
    modality = config.pop("modality_config", None)
    if modality is not None and _normal_modality(modality) != _TEXT_MODALITY:
        raise ModelError(
            f"{where}: modality_config {json.dumps(modality)} is not plain text through the "
            "model's forward (chat templates, images, audio): the pipeline does not run it"
        )
    for key in ("query_length", "document_length", "query_expansion"):
        if config.pop(key, None) is not None:
            raise ModelError(f"{where}: {key} (a multi-vector setting) is not reproduced")
    if config.pop("processing_kwargs", None):
        raise ModelError(f"{where}: processing_kwargs are not reproduced by the pipeline")
    config.pop("unpad_inputs", None)  # flash-attention unpadding: the same values
    max_seq = config.pop("max_seq_length", None)
    if max_seq is not None and (not isinstance(max_seq, int) or max_seq < 1):
        raise ModelError(f"{where}: max_seq_length {max_seq!r} is not a length")
    lower = config.pop("do_lower_case", False)
    kwargs = {
        new: _kwargs(config.pop(old, None), config.pop(new, None), where)
        for old, new in (
            ("tokenizer_args", "processor_kwargs"),
            ("model_args", "model_kwargs"),
            ("config_args", "config_kwargs"),
        )
    }
    model_kwargs = {
        k: v for k, v in kwargs["model_kwargs"].items() if k not in _MODEL_KWARGS_IGNORED
    }
    if config:
        raise ModelError(f"{where}: settings {', '.join(sorted(config))} are not reproduced")
    return TransformerModule(
        folder,
        max_seq,
        bool(lower),
        json.dumps(kwargs["processor_kwargs"], sort_keys=True),
        json.dumps(model_kwargs, sort_keys=True),
        json.dumps(kwargs["config_kwargs"], sort_keys=True),
    )


def _normal_modality(modality: Any) -> Any:
    """method_output_name may be a string or a one-element list: the same thing."""
    if not isinstance(modality, dict):
        return modality
    normal = {}
    for key, params in modality.items():
        if isinstance(params, dict) and isinstance(params.get("method_output_name"), list):
            names = params["method_output_name"]
            params = {**params, "method_output_name": names[0] if len(names) == 1 else names}
        normal[key] = params
    return normal


def _kwargs(old: Any, new: Any, where: Path) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for value in (old, new):
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ModelError(f"{where}: {value!r} is not a mapping of arguments")
        merged.update(value)
    return {k: v for k, v in merged.items() if k not in _HUB_KWARGS}


def _pooling(folder: Path) -> Pooling:
    where = folder / "config.json"
    config = _json_object(where)
    if not config:
        raise ModelError(f"{where} is missing or empty: the pooling is unknown")
    dimension = config.pop("embedding_dimension", config.pop("word_embedding_dimension", None))
    if not isinstance(dimension, int) or dimension < 1:
        raise ModelError(f"{where}: embedding_dimension {dimension!r} is not a dimension")
    include_prompt = config.pop("include_prompt", True)
    legacy = {key: config.pop(key) for key in list(config) if key in LEGACY_POOLING_KEYS}
    mode = config.pop("pooling_mode", None)
    if mode is None:
        active = tuple(LEGACY_POOLING_KEYS[k] for k in LEGACY_POOLING_KEYS if legacy.get(k))
        modes = active or ("mean",)
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown or not modes:
        raise ModelError(f"{where}: pooling mode {unknown or modes} is not one of {POOLING_MODES}")
    if config:
        unknown_keys = ", ".join(sorted(config))
        raise ModelError(f"{where}: pooling settings {unknown_keys} are not reproduced")
    return Pooling(modes, bool(include_prompt), dimension)


def _head_module(kind: str, folder: Path, dim: int) -> HeadModule | None:
    config = _json_object(folder / "config.json")
    where = folder / "config.json"
    if kind == "Dropout":
        return None
    if kind == "Normalize":
        _expect(config, "module_input_name", "sentence_embedding", where)
        _expect(config, "module_output_name", "sentence_embedding", where)
        return Normalize()
    if kind == "LayerNorm":
        dimension = config.get("dimension")
        if dimension != dim:
            raise ModelError(f"{where}: LayerNorm of {dimension} values after a {dim}-d output")
        return LayerNorm(_weights_folder(folder), dim)
    return _dense(folder, config, dim)


def _dense(folder: Path, config: dict[str, Any], dim: int) -> Dense:
    where = folder / "config.json"
    _expect(config, "module_input_name", "sentence_embedding", where)
    _expect(config, "module_output_name", "sentence_embedding", where)
    in_features, out_features = config.get("in_features"), config.get("out_features")
    if in_features != dim or not isinstance(out_features, int) or out_features < 1:
        raise ModelError(
            f"{where}: Dense {in_features}->{out_features} does not follow a {dim}-d output"
        )
    activation = config.get("activation_function", _TANH)
    if activation is None:
        activation = _IDENTITY_MODULE
    if not isinstance(activation, str) or not activation.startswith("torch."):
        # sentence-transformers itself would silently fall back to Tanh here.
        raise ModelError(
            f"{where}: activation {activation!r} is not a torch module; the pipeline runs no "
            "code from model folders"
        )
    return Dense(
        _weights_folder(folder),
        in_features,
        out_features,
        bool(config.get("bias", True)),
        activation,
        bool(config.get("use_residual", False)),
    )


def _weights_folder(folder: Path) -> Path:
    if (folder / "model.safetensors").is_file():
        return folder
    if (folder / "pytorch_model.bin").is_file():
        raise ModelError(
            f"{folder} holds its weights as pytorch_model.bin: the pipeline loads safetensors "
            "only (re-save the model with sentence-transformers >= 3, which writes "
            "model.safetensors)"
        )
    raise ModelError(f"{folder} has no model.safetensors")


def _expect(config: dict[str, Any], key: str, value: Any, where: Path) -> None:
    found = config.pop(key, value)
    if found is not None and found != value:
        raise ModelError(f"{where}: {key} {found!r} is not reproduced (only {value!r})")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path} is not readable JSON: {exc}") from exc


def _json_object(path: Path) -> dict[str, Any]:
    value = _read_json(path)
    return dict(value) if isinstance(value, dict) else {}
