"""What runs after the transformer: pooling, the Dense and LayerNorm modules,
normalisation and Matryoshka truncation, as sentence-transformers computes them
(the truncation last, with no normalisation after it).

Rows come right-padded (the pipeline pads after the text); the pooling below is
sentence-transformers' padded-input path, op for op, so that its edge cases (a
prompt excluded from pooling, a text shorter than its prompt) give the same
values. It runs in fp32 whatever the model's precision, as the pooled values are
what is stored.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.core.errors import ModelError
from pipeline.model.stack import Dense, LayerNorm, ModuleStack, Normalize


class Head(nn.Module):
    """(last hidden state, attention mask, prompt length) -> the stored vectors."""

    def __init__(self, stack: ModuleStack, truncate_dim: int | None) -> None:
        super().__init__()
        self.modes = stack.pooling.modes
        self.include_prompt = stack.pooling.include_prompt
        self.layers = nn.ModuleList(_layer(module) for module in stack.head)
        # Matryoshka: the first `truncate_dim` values, cut after every module and not
        # normalised again, as SentenceTransformer(truncate_dim=N).encode() gives them
        # (the index normalises where the model's similarity asks: sinks.index.metric).
        self.truncate_dim = truncate_dim

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor, prompt_length: int = 0) -> Any:
        hidden = hidden.float()
        if prompt_length and not self.include_prompt:
            mask = mask.clone()
            mask[:, :prompt_length] = 0
        x = torch.cat([_pool(hidden, mask, mode) for mode in self.modes], dim=-1)
        for layer in self.layers:
            x = layer(x)
        if self.truncate_dim is not None:
            x = x[:, : self.truncate_dim]
        return x


def _pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """One pooling mode over right-padded rows (sentence_transformers Pooling)."""
    if mode == "cls":
        first = mask.to(torch.int).argmax(dim=1)
        index = first[:, None, None].expand(-1, 1, hidden.shape[-1])
        return torch.gather(hidden, 1, index).squeeze(1)
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values
    if mode in ("mean", "mean_sqrt_len_tokens"):
        total = (hidden * weights).sum(dim=1)
        count = torch.clamp(weights.sum(dim=1), min=1e-9)
        return total / (count if mode == "mean" else torch.sqrt(count))
    if mode == "weightedmean":
        # Positions count from 1 at the first real token: rows are right-padded.
        positions = torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype)
        weighted = weights * positions.to(hidden.device).view(1, -1, 1)
        return (hidden * weighted).sum(dim=1) / torch.clamp(weighted.sum(dim=1), min=1e-9)
    if mode == "lasttoken":
        seq_len = hidden.shape[1]
        values, indices = mask.flip(1).max(1)
        indices = torch.where(values == 0, seq_len - 1, indices)
        index = (seq_len - indices - 1)[:, None, None].expand(-1, 1, hidden.shape[-1])
        return torch.gather(hidden * weights, 1, index).squeeze(1)
    raise ModelError(f"pooling mode {mode!r} is not implemented")


class _Dense(nn.Module):
    def __init__(self, spec: Dense) -> None:
        super().__init__()
        weights = _load(spec.directory)
        self.linear = _linear(weights, "linear", spec.bias, spec)
        self.activation = activation(spec.activation)
        self.residual: nn.Module | None = None
        if spec.residual:
            same = spec.in_features == spec.out_features
            self.residual = nn.Identity() if same else _linear(weights, "residual", False, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(x))
        return out if self.residual is None else out + self.residual(x)


def _linear(weights: dict[str, torch.Tensor], name: str, bias: bool, spec: Dense) -> nn.Linear:
    layer = nn.Linear(spec.in_features, spec.out_features, bias=bias)
    expected = {f"{name}.weight": (spec.out_features, spec.in_features)}
    if bias:
        expected[f"{name}.bias"] = (spec.out_features,)
    for key, shape in expected.items():
        tensor = weights.get(key)
        if tensor is None or tuple(tensor.shape) != shape:
            found = None if tensor is None else tuple(tensor.shape)
            raise ModelError(f"{spec.directory}: weight {key} is {found}, expected {shape}")
    layer.weight = nn.Parameter(weights[f"{name}.weight"].float(), requires_grad=False)
    if bias:
        layer.bias = nn.Parameter(weights[f"{name}.bias"].float(), requires_grad=False)
    return layer


def _layer(module: Dense | LayerNorm | Normalize) -> nn.Module:
    if isinstance(module, Dense):
        return _Dense(module)
    if isinstance(module, LayerNorm):
        weights = _load(module.directory)
        norm = nn.LayerNorm(module.dimension)  # sentence-transformers' default eps
        for name in ("weight", "bias"):
            tensor = weights.get(f"norm.{name}")
            if tensor is None or tuple(tensor.shape) != (module.dimension,):
                raise ModelError(f"{module.directory}: weight norm.{name} is missing or misshapen")
            setattr(norm, name, nn.Parameter(tensor.float(), requires_grad=False))
        return norm
    return _Normalize()


class _Normalize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(x, p=2, dim=-1)


def activation(dotted: str) -> nn.Module:
    """A torch.nn module class by its dotted path, made without arguments (as
    sentence-transformers makes a Dense module's activation)."""
    module_name, _, class_name = dotted.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ModelError(f"activation {dotted} is not in this torch: {exc}") from exc
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise ModelError(f"activation {dotted} is not a torch.nn module class")
    try:
        return found()
    except TypeError as exc:
        raise ModelError(f"activation {dotted} needs arguments: {exc}") from exc


def _load(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(directory / "model.safetensors"), device="cpu")
    except Exception as exc:  # safetensors raises its own error classes
        raise ModelError(f"cannot read {directory / 'model.safetensors'}: {exc}") from exc
