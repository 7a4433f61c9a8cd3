"""A BERT-family encoder in plain torch, for inference: what Embedder runs by default.

transformers' BertModel costs seconds of imports before the first pass (its modeling
code pulls in torch._dynamo and torch.distributed.tensor) and, per pass, Python
wrappers around every layer (attention dispatch, mask building, output classes) that
dominate when the model is small or the device is fast. This module computes the
same last hidden state with a few torch modules and never imports transformers:

- embeddings: word + token type (always 0: one text per row) + absolute position,
  then LayerNorm; RoBERTa/XLM-R count positions from padding_idx + 1 over non-pad
  tokens, as fairseq did;
- N layers of self-attention (`scaled_dot_product_attention`, query/key/value as one
  fused nn.Linear) + dense + residual LayerNorm, then the feed-forward block.

Layers are nn.Linear and nn.LayerNorm, so that `.to(dtype/device)` and dynamic int8
quantisation (which swaps nn.Linear) work as on transformers' model. Weights come
from the folder's safetensors files only; every tensor the config implies must be
there with its shape, or the folder is `Incomplete` and the caller falls back.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

# model_type -> the prefix a task head's checkpoint puts on the encoder's names.
FAMILIES = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta"}
# Position ids start at padding_idx + 1 in these (fairseq's make_positions).
OFFSET_POSITIONS = {"roberta", "xlm-roberta"}
QKV = ("query", "key", "value")
# hidden_act -> activation; "gelu" is BERT's exact (erf) GELU, the "new"/tanh ones
# its approximation.
ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}
# Defaults of transformers' BertConfig/RobertaConfig for keys a config.json may omit.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 30522,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "position_embedding_type": "absolute",
}


class Unsupported(Exception):
    """The folder is not one this encoder runs (the reason is the message)."""


class Incomplete(Unsupported):
    """A supported model type whose weights are missing tensors or have other shapes."""


@dataclass(frozen=True)
class EncoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads


def supports(model_type: str | None) -> bool:
    return model_type in FAMILIES


def read_config(path: Path) -> EncoderConfig:
    """The encoder's shape from config.json; Unsupported for what it does not implement."""
    raw = json.loads((path / "config.json").read_text())
    model_type = raw.get("model_type")
    if not supports(model_type):
        raise Unsupported(f"model_type {model_type!r} has no native encoder")
    values = {**DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    if values["position_embedding_type"] != "absolute":
        raise Unsupported(f"position_embedding_type {values['position_embedding_type']!r}")
    if values["hidden_act"] not in ACTIVATIONS:
        raise Unsupported(f"hidden_act {values['hidden_act']!r}")
    if raw.get("is_decoder") or raw.get("add_cross_attention"):
        raise Unsupported("a decoder configuration (is_decoder / add_cross_attention)")
    if values["hidden_size"] % values["num_attention_heads"]:
        raise Unsupported("hidden_size is not a multiple of num_attention_heads")
    pad = raw.get("pad_token_id")
    return EncoderConfig(
        model_type=model_type,
        pad_token_id=int(pad if pad is not None else (1 if model_type in OFFSET_POSITIONS else 0)),
        hidden_act=str(values["hidden_act"]),
        layer_norm_eps=float(values["layer_norm_eps"]),
        **{
            key: int(values[key])
            for key in (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "intermediate_size",
                "max_position_embeddings",
                "type_vocab_size",
            )
        },
    )


# A checkpoint tensor by its name (transformers' BertModel naming), as fp32.
Weights = Callable[[str], torch.Tensor]


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _linear(weights: Weights, name: str) -> nn.Linear:
    return _linear_of(weights(f"{name}.weight"), weights(f"{name}.bias"))


def _linear_of(weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    """An nn.Linear (the exact class: int8 quantisation swaps it by type) holding these
    tensors, never initialised at random first: that costs 0.1-1 s per model, and on
    the meta device it imports torch._dynamo (seconds)."""
    layer = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(layer)
    layer.out_features, layer.in_features = weight.shape
    layer.weight, layer.bias = _parameter(weight), _parameter(bias)
    return layer


def _layer_norm(weights: Weights, name: str, eps: float) -> nn.LayerNorm:
    weight = weights(f"{name}.weight")
    norm = nn.LayerNorm(weight.shape[0], eps=eps)  # ones and zeros: cheap
    norm.weight, norm.bias = _parameter(weight), _parameter(weights(f"{name}.bias"))
    return norm


def _embedding(weights: Weights, name: str) -> nn.Embedding:
    return nn.Embedding.from_pretrained(weights(f"{name}.weight"), freeze=True)


class Embeddings(nn.Module):
    def __init__(self, config: EncoderConfig, weights: Weights) -> None:
        super().__init__()
        self.word_embeddings = _embedding(weights, "embeddings.word_embeddings")
        self.position_embeddings = _embedding(weights, "embeddings.position_embeddings")
        self.token_type_embeddings = _embedding(weights, "embeddings.token_type_embeddings")
        self.LayerNorm = _layer_norm(weights, "embeddings.LayerNorm", config.layer_norm_eps)
        self.offset_positions = config.model_type in OFFSET_POSITIONS
        self.pad_token_id = config.pad_token_id

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Summed in transformers' order (word + type, then + position): same rounding.
        x = self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0]
        if self.offset_positions:
            real = input_ids.ne(self.pad_token_id).int()
            positions = torch.cumsum(real, dim=1).int() * real + self.pad_token_id
            x = x + self.position_embeddings(positions.long())
        else:  # positions 0..seq-1 for every row: a slice, no gather
            x = x + self.position_embeddings.weight[: input_ids.shape[1]]
        return self.LayerNorm(x)


class Layer(nn.Module):
    """One encoder layer: self-attention and feed-forward, each with a residual LayerNorm."""

    def __init__(self, config: EncoderConfig, weights: Weights, index: int) -> None:
        super().__init__()
        eps, name = config.layer_norm_eps, f"encoder.layer.{index}."
        self.heads, self.head_size = config.num_attention_heads, config.head_size
        # One product for query, key and value: a third of the kernel launches.
        self.qkv = _linear_of(
            *(
                torch.cat([weights(f"{name}attention.self.{m}.{part}") for m in QKV])
                for part in ("weight", "bias")
            )
        )
        self.attention_output = _linear(weights, f"{name}attention.output.dense")
        self.attention_norm = _layer_norm(weights, f"{name}attention.output.LayerNorm", eps)
        self.intermediate = _linear(weights, f"{name}intermediate.dense")
        self.output = _linear(weights, f"{name}output.dense")
        self.output_norm = _layer_norm(weights, f"{name}output.LayerNorm", eps)
        self.activation = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, hidden = x.shape
        qkv = self.qkv(x).view(batch, seq, 3, self.heads, self.head_size).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=mask)
        attended = attended.transpose(1, 2).reshape(batch, seq, hidden)
        x = self.attention_norm(self.attention_output(attended) + x)
        return self.output_norm(self.output(self.activation(self.intermediate(x))) + x)


class BertEncoder(nn.Module):
    """Token ids (and a key-padding mask, or None when no row is padded) -> the last
    hidden state, (batch, seq, hidden)."""

    returns_hidden_state = True  # Embedder: the output is the tensor, not a ModelOutput

    def __init__(self, config: EncoderConfig, weights: Weights) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config, weights)
        self.layers = nn.ModuleList(
            Layer(config, weights, i) for i in range(config.num_hidden_layers)
        )

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.embeddings(input_ids)
        # (batch, 1, 1, keys), True where a key is a real token; broadcast over heads
        # and queries. A padded query still attends to its row's real tokens, so no
        # row of the mask is all False (no NaN), as in transformers.
        mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        return x


def expected_tensors(config: EncoderConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint names (transformers' BertModel/RobertaModel) and shapes the config implies."""
    hidden, inner = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (config.vocab_size, hidden),
        "embeddings.position_embeddings.weight": (config.max_position_embeddings, hidden),
        "embeddings.token_type_embeddings.weight": (config.type_vocab_size, hidden),
        "embeddings.LayerNorm.weight": (hidden,),
        "embeddings.LayerNorm.bias": (hidden,),
    }
    for i in range(config.num_hidden_layers):
        layer = f"encoder.layer.{i}."
        for name, out, into in (
            *((f"attention.self.{m}", hidden, hidden) for m in QKV),
            ("attention.output.dense", hidden, hidden),
            ("intermediate.dense", inner, hidden),
            ("output.dense", hidden, inner),
        ):
            shapes[f"{layer}{name}.weight"] = (out, into)
            shapes[f"{layer}{name}.bias"] = (out,)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[f"{layer}{norm}.weight"] = (hidden,)
            shapes[f"{layer}{norm}.bias"] = (hidden,)
    return shapes


def weight_files(path: Path) -> list[Path]:
    """The safetensors files transformers would read: the index's shards, or model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    single = path / "model.safetensors"
    if not single.is_file():
        raise Unsupported(f"no model.safetensors in {path}")
    return [single]


def read_tensors(path: Path, config: EncoderConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under BertModel's names: a task head's prefix ("bert.",
    "roberta.") dropped, TF-era LayerNorm gamma/beta renamed."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        if not file.is_file():
            raise Incomplete(f"weight shard {file.name} is missing")
        tensors.update(load_file(str(file), device="cpu"))
    fault_in(tensors.values())
    prefix = FAMILIES[config.model_type] + "."
    if not any(name.startswith("embeddings.") for name in tensors):
        tensors = {k.removeprefix(prefix): v for k, v in tensors.items()}
    return {_modern_name(name): tensor for name, tensor in tensors.items()}


def fault_in(tensors: Iterable[torch.Tensor]) -> None:
    """Reads one value per page of each tensor, so that memory-mapped weights are
    resident from the start. safetensors maps the file and its pages come in as
    they are first used: the word-embedding table's rows as each token id is first
    met, so a nearline worker's RSS crept up for minutes: growth that looks like a
    leak to anyone watching memory (docs/performance.md). Reading them costs a few
    milliseconds."""
    for tensor in tensors:
        if tensor.numel():
            per_page = max(1, 4096 // tensor.element_size())
            tensor.reshape(-1)[::per_page].sum()


def _modern_name(name: str) -> str:
    if name.endswith(".gamma"):
        return name.removesuffix(".gamma") + ".weight"
    if name.endswith(".beta"):
        return name.removesuffix(".beta") + ".bias"
    return name


def check_tensors(tensors: dict[str, torch.Tensor], config: EncoderConfig) -> None:
    """Incomplete, naming the first problems, unless every expected tensor is there
    with its shape (transformers would initialise missing ones at random)."""
    expected = expected_tensors(config)
    missing = [name for name in expected if name not in tensors]
    wrong = [
        f"{name} {tuple(tensors[name].shape)} (config: {shape})"
        for name, shape in expected.items()
        if name in tensors and tuple(tensors[name].shape) != shape
    ]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise Incomplete(f"weights lack {', '.join(missing[:3])}{more}")
    if wrong:
        raise Incomplete(f"weights of other shapes: {', '.join(wrong[:3])}")


def load_encoder(path: Path, config: EncoderConfig | None = None) -> BertEncoder:
    """The encoder of the model folder at `path`, in eval mode on the CPU, fp32 (the
    precision is applied afterwards, as on transformers' model).

    Raises Unsupported (Incomplete for damaged weights) when it cannot be run here."""
    config = config or read_config(path)
    tensors = read_tensors(path, config)
    check_tensors(tensors, config)
    return BertEncoder(config, lambda name: tensors[name].float()).eval()


__all__ = [
    "BertEncoder",
    "EncoderConfig",
    "Incomplete",
    "Unsupported",
    "load_encoder",
    "supports",
]
