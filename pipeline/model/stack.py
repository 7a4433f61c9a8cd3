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
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeline.core.errors import ModelError
from pipeline.core.model_info import DEFAULT_SIMILARITY, SIMILARITIES

log = logging.getLogger(__name__)

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
# modules.json entry keys sentence-transformers reads (type, path, name; kwargs: the
# encode() arguments it passes to the module, such as encode_document's task, so
# only an empty list) and keeps for itself (idx). Any other key is refused.
_ENTRY_KEYS = {"idx", "name", "path", "type", "kwargs"}
_TEXT_MODALITY = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
# Transformer config keys that change no vector: flash-attention unpadding (the same
# values), and what sentence-transformers replaces with its own load call's (backend)
# or uses only to find files (cache_dir).
_TRANSFORMER_HARMLESS = ("unpad_inputs", "backend", "cache_dir")
# The old and new names of the Transformer's from_pretrained arguments: where a file
# has both, sentence-transformers takes the old one whole (Transformer._load_init_kwargs).
_KWARGS_NAMES = (
    ("tokenizer_args", "processor_kwargs"),
    ("model_args", "model_kwargs"),
    ("config_args", "config_kwargs"),
)
# model_kwargs that change no value the pipeline computes: attention kernels and
# device placement compute the same function. (torch_dtype / dtype: _check_dtype.)
_MODEL_KWARGS_IGNORED = {"attn_implementation", "device_map"}
# What a file's kwargs say of these never reaches transformers: sentence-transformers
# overwrites them with its own load call's (hub kwargs outrank the config file in
# Transformer._load_init_kwargs), so a file's `revision` loads no other weights there
# either, and trust_remote_code is never taken from a file.
_HUB_KWARGS = {
    "trust_remote_code", "revision", "token", "cache_dir", "local_files_only", "subfolder",
}  # fmt: skip
_DTYPES_AS_PIPELINE = {"auto", "float32", "float"}  # fp32, or the checkpoint's own (the default)
_DTYPES_OTHER = {"float16", "half", "bfloat16", "float64", "double"}
# A module's config keys sentence-transformers reads, by module type (Transformer and
# Pooling: their own readers below).
_MODULE_KEYS = {
    "Dense": {
        "in_features", "out_features", "bias", "activation_function", "module_input_name",
        "module_output_name", "use_residual",
    },
    "LayerNorm": {"dimension"},
    "Normalize": {"module_input_name", "module_output_name"},
    "Dropout": {"dropout"},  # nothing at inference, whatever its rate
}  # fmt: skip
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
    # The width of the token embeddings it pools: the transformer's hidden size where
    # its config.json names one (sentence-transformers pools what the transformer
    # gives, whatever the Pooling config says), else the Pooling config's.
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
    # How its vectors are compared (config_sentence_transformers.json's similarity_fn_name).
    similarity: str = DEFAULT_SIMILARITY

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
    similarity = read_similarity(st_config)
    modules = _read_json(path / "modules.json")
    if modules is None:
        return replace(_default_stack(path, config, truncate_dim), similarity=similarity)
    if not isinstance(modules, list) or not modules:
        raise ModelError(f"{path / 'modules.json'} lists no modules")
    kinds = [_module_kind(path, entry) for entry in modules]
    if kinds[:2] != ["Transformer", "Pooling"]:
        raise ModelError(
            f"model {path}: module stack {' > '.join(kinds)} does not start with Transformer, "
            "then Pooling: the pipeline does not reproduce it"
        )
    transformer = _transformer(path / _module_path(modules[0]))
    width = hidden_size(_json_object(transformer.directory / "config.json"))
    pooling = _pooling(path / _module_path(modules[1]), width)
    head: list[HeadModule] = []
    dim = pooling.output_dimension
    for entry, kind in zip(modules[2:], kinds[2:], strict=True):
        folder = path / _module_path(entry)
        if kind in ("Transformer", "Pooling"):
            raise ModelError(
                f"model {path}: a second {kind} module ({folder.name or 'the root'}) after "
                f"{' > '.join(kinds[:2])}: the pipeline reproduces one of each, first"
            )
        module = _head_module(kind, folder, dim)
        if module is None:
            continue  # Dropout: nothing at inference
        if isinstance(module, Dense):
            dim = module.out_features
        head.append(module)
    return ModuleStack(transformer, pooling, tuple(head), truncate_dim, similarity=similarity)


def read_similarity(st_config: dict[str, Any]) -> str:
    """The model's similarity_fn_name as sentence-transformers 6 takes it: one of
    SIMILARITIES, else (none, or a name it does not support for dense vectors) cosine."""
    named = st_config.get("similarity_fn_name")
    return named if named in SIMILARITIES else DEFAULT_SIMILARITY


def folder_similarity(path: Path) -> str:
    """read_similarity of the model folder at `path`."""
    return read_similarity(_json_object(path / ST_CONFIG))


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
    where = path / "modules.json"
    if not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
        raise ModelError(f"{where}: {entry!r} is not a module entry")
    kind: str = entry["type"]
    name = kind.rsplit(".", 1)[-1]
    if not kind.startswith("sentence_transformers.") or name not in SUPPORTED_MODULES:
        raise ModelError(
            f"model {path}: module {kind} is not one the pipeline reproduces "
            f"({', '.join(SUPPORTED_MODULES)}); refusing it rather than writing vectors that "
            "differ from sentence-transformers'"
        )
    if not isinstance(entry.get("path"), str):
        raise ModelError(f"{where}: module {name} names no path (sentence-transformers needs one)")
    unknown = sorted(set(entry) - _ENTRY_KEYS)
    if unknown:
        raise ModelError(f"{where}: module {name}: keys {', '.join(unknown)} are not reproduced")
    if entry.get("kwargs", []) != []:
        raise ModelError(
            f"{where}: module {name} takes encode() arguments {entry['kwargs']!r}, which "
            "the pipeline does not pass (not reproduced)"
        )
    return name


def _module_path(entry: dict[str, Any]) -> str:
    relative = str(entry["path"])
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
    for key in _TRANSFORMER_HARMLESS:
        config.pop(key, None)
    max_seq = config.pop("max_seq_length", None)
    if max_seq is not None and (not isinstance(max_seq, int) or max_seq < 1):
        raise ModelError(f"{where}: max_seq_length {max_seq!r} is not a length")
    lower = config.pop("do_lower_case", False)
    if not isinstance(lower, bool):
        raise ModelError(f"{where}: do_lower_case {lower!r} is not true or false")
    kwargs = {new: _kwargs(config, old, new, where) for old, new in _KWARGS_NAMES}
    _refuse_unknown(config, where, "Transformer")
    return TransformerModule(
        folder,
        max_seq,
        lower,
        json.dumps(kwargs["processor_kwargs"], sort_keys=True),
        json.dumps(_model_kwargs(kwargs["model_kwargs"], where), sort_keys=True),
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


def _kwargs(config: dict[str, Any], old: str, new: str, where: Path) -> dict[str, Any]:
    """One of the Transformer's from_pretrained arguments as sentence-transformers takes
    it from the file: the old name whole where both are there, less the hub kwargs."""
    value = config.pop(old) if old in config else config.get(new)
    config.pop(new, None)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ModelError(f"{where}: {old} / {new} {value!r} is not a mapping of arguments")
    return {k: v for k, v in value.items() if k not in _HUB_KWARGS}


def _model_kwargs(kwargs: dict[str, Any], where: Path) -> dict[str, Any]:
    """model_kwargs as the pipeline passes them to transformers (its own dtype instead)."""
    for key in ("torch_dtype", "dtype"):
        if key in kwargs:
            _check_dtype(key, kwargs.pop(key), where)
    return {k: v for k, v in kwargs.items() if k not in _MODEL_KWARGS_IGNORED}


def _check_dtype(key: str, value: Any, where: Path) -> None:
    """The dtype sentence-transformers computes the model in; the pipeline computes at
    --precision. fp32 (or the checkpoint's own, the default) is the known case; another
    one differs from the pipeline's fp32 by rounding alone, which is said, not hidden."""
    name = value.removeprefix("torch.") if isinstance(value, str) else value
    if name in _DTYPES_AS_PIPELINE:
        return
    if name not in _DTYPES_OTHER:
        raise ModelError(f"{where}: model_args {key} {value!r} is not a dtype the pipeline knows")
    log.warning(
        "%s: model_args %s %r: sentence-transformers computes this model in %s (on the CPU "
        "too), the pipeline at --precision: vectors differ by rounding (docs/models.md)",
        where,
        key,
        value,
        name,
    )


def _pooling(folder: Path, width: int | None) -> Pooling:
    """`width`: the transformer's hidden size (None where its config names none)."""
    where = folder / "config.json"
    config = _json_object(where)
    if not config:
        raise ModelError(f"{where} is missing or empty: the pooling is unknown")
    dimension = config.pop("embedding_dimension", config.pop("word_embedding_dimension", None))
    if not isinstance(dimension, int) or dimension < 1:
        raise ModelError(f"{where}: embedding_dimension {dimension!r} is not a dimension")
    include_prompt = config.pop("include_prompt", True)
    if not isinstance(include_prompt, bool):
        raise ModelError(f"{where}: include_prompt {include_prompt!r} is not true or false")
    legacy = {key: config.pop(key) for key in list(config) if key in LEGACY_POOLING_KEYS}
    mode = config.pop("pooling_mode", None)
    if mode is None:
        active = tuple(LEGACY_POOLING_KEYS[k] for k in LEGACY_POOLING_KEYS if legacy.get(k))
        modes = active or ("mean",)
    elif isinstance(mode, str):
        modes = (mode,)
    elif isinstance(mode, list) and all(isinstance(m, str) for m in mode):
        modes = tuple(mode)
    else:
        raise ModelError(f"{where}: pooling_mode {mode!r} is not a mode or a list of modes")
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown or not modes:
        raise ModelError(f"{where}: pooling mode {unknown or modes} is not one of {POOLING_MODES}")
    _refuse_unknown(config, where, "Pooling")
    if width is not None and width != dimension:
        log.warning(
            "%s: embedding_dimension %d, but the transformer's token embeddings have %d values "
            "(config.json): sentence-transformers pools those, %d values a mode, and so does "
            "the pipeline",
            where,
            dimension,
            width,
            width,
        )
    return Pooling(modes, include_prompt, width or dimension)


def _head_module(kind: str, folder: Path, dim: int) -> HeadModule | None:
    """The module after Pooling of this kind; `dim`: the width of what it is given."""
    where = folder / "config.json"
    config = _json_object(where)
    _refuse_unknown({k: v for k, v in config.items() if k not in _MODULE_KEYS[kind]}, where, kind)
    if kind == "Dropout":
        return None
    if kind == "Normalize":
        _expect(config, "module_input_name", "sentence_embedding", where)
        _expect(config, "module_output_name", "sentence_embedding", where)
        return Normalize()
    if kind == "LayerNorm":
        dimension = config.get("dimension")
        if dimension != dim:
            # nn.LayerNorm(dimension) fails on other widths in sentence-transformers too.
            raise ModelError(f"{where}: LayerNorm of {dimension} values after a {dim}-d output")
        return LayerNorm(_weights_folder(folder), dim)
    return _dense(folder, config, dim)


def _dense(folder: Path, config: dict[str, Any], dim: int) -> Dense:
    where = folder / "config.json"
    _expect(config, "module_input_name", "sentence_embedding", where)
    _expect(config, "module_output_name", "sentence_embedding", where)
    in_features, out_features = config.get("in_features"), config.get("out_features")
    for key, value in (("in_features", in_features), ("out_features", out_features)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelError(f"{where}: Dense {key} {value!r} is not a dimension")
    if in_features != dim:
        # Its linear layer fails on other widths in sentence-transformers too.
        raise ModelError(f"{where}: Dense of {in_features}-d input after a {dim}-d output")
    activation = config.get("activation_function", _TANH)
    if not isinstance(activation, str) or not activation.startswith("torch."):
        # sentence-transformers itself would silently fall back to Tanh here.
        raise ModelError(
            f"{where}: activation {activation!r} is not a torch module; the pipeline runs no "
            "code from model folders"
        )
    flags = {key: config.get(key, key == "bias") for key in ("bias", "use_residual")}
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise ModelError(f"{where}: Dense {key} {value!r} is not true or false")
    return Dense(
        _weights_folder(folder),
        in_features,
        out_features,
        flags["bias"],
        activation,
        flags["use_residual"],
    )


def _refuse_unknown(config: dict[str, Any], where: Path, kind: str) -> None:
    """Refuses, by name, the settings left in `config` once what is reproduced is taken."""
    if config:
        raise ModelError(f"{where}: {kind} settings {', '.join(sorted(config))} are not reproduced")


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
    """`key` absent, or `value`; None too for an output name (sentence-transformers
    then writes where it reads)."""
    found = config.pop(key, value)
    if found is None and key == "module_output_name":
        return
    if found != value:
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
