"""SmoothQuant's smoothing (Xiao et al., 2023, arXiv:2211.10438), applied exactly to a
torch network before OpenVINO converts it.

Dynamic int8 quantises each token's activations with one scale per group of values. A
few channels of a transformer's activations run far larger than the rest (BERT's
outlier dimensions), so a group that holds one quantises the others coarsely; that is
why the first int8 recipe needed groups of 32. Smoothing moves that range into the
weights, which are quantised per output channel and absorb it: for each linear layer
but the down-projections (`smoothable`), a per-input-channel scale `s`,

    y = W x = (W diag(s)) (x / s),    s_j = max|x_j| ** alpha / max|W[:, j]| ** (1 - alpha)

with max|x_j| measured on calibration text. The division is an elementwise product
before the layer (it costs nothing measurable); the network computes the same
function. Only the scales come from the calibration text: the quantisation itself
stays dynamic, each pass's own range, so text unlike the calibration's is not
clipped.

The layers that read more values than they write (the feed-forward block's
down-projections, which read the activation function's outputs) are not smoothed:
smoothed, they lost more than they did unsmoothed (docs/performance.md). They carry
most of int8's loss: the recipe leaves them in floating point, or quantises them
unsmoothed where the model keeps a margin over the gate (pipeline.model.int8_margin).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

# Chosen by measurement among 0.5-0.85 on MiniLM and multilingual-e5 over English,
# Chinese, mixed text and log lines (docs/performance.md: smoothing).
ALPHA = 0.7


class SmoothedLinear(nn.Module):
    """`linear` with its input divided by `scale` and its weight's columns times it."""

    def __init__(self, linear: nn.Linear, scale: torch.Tensor) -> None:
        super().__init__()
        self.linear = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(self.linear)
        self.linear.in_features, self.linear.out_features = linear.in_features, linear.out_features
        self.linear.weight = nn.Parameter(linear.weight * scale, requires_grad=False)
        self.linear.bias = linear.bias
        self.register_buffer("inverse", (1.0 / scale).to(linear.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x * self.inverse)


def smoothable(linear: nn.Linear) -> bool:
    """Whether smoothing applies to this layer: not a down-projection (one that reads
    more values than it writes)."""
    return linear.in_features <= linear.out_features


def _linears(net: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) for every nn.Linear smoothing applies to."""
    for parent in list(net.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and smoothable(child):
                yield parent, name, child


def input_ranges(
    net: nn.Module,
    forward: Callable[[torch.Tensor, torch.Tensor], Any],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
) -> dict[tuple[int, str], torch.Tensor]:
    """Each quantised linear layer's largest absolute input per channel over the real
    tokens of the calibration `batches` (ids and mask, right-padded), each passed
    through `net` by `forward`; keyed by (parent's id, attribute)."""
    ranges: dict[tuple[int, str], torch.Tensor] = {}
    real: list[torch.Tensor] = []  # the batch in flight's mask, as booleans
    hooks = []
    for parent, name, linear in _linears(net):
        key = (id(parent), name)

        def record(_m: nn.Module, args: tuple[Any, ...], _out: Any, key: Any = key) -> None:
            x = args[0].detach()
            # A padded token's values are not text's: left out where the shape shows
            # which they are (a row per token); a layer on pooled rows takes them all.
            x = x[real[0]] if x.shape[:-1] == real[0].shape else x.reshape(-1, x.shape[-1])
            seen = x.abs().amax(0).float()
            ranges[key] = torch.maximum(ranges[key], seen) if key in ranges else seen

        hooks.append(linear.register_forward_hook(record))
    try:
        with torch.no_grad():
            for ids, mask in batches:
                real[:] = [mask.bool()]
                forward(ids, mask)
    finally:
        for hook in hooks:
            hook.remove()
    return ranges


def scales(activation: torch.Tensor, weight: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """SmoothQuant's per-input-channel scales (channels never seen active keep 1)."""
    weight_range = weight.detach().abs().amax(0).float().clamp(min=1e-5)
    scale = activation.clamp(min=1e-5) ** alpha / weight_range ** (1 - alpha)
    return torch.where(activation > 0, scale, torch.ones_like(scale)).clamp(1e-3, 1e3)


@contextmanager
def smoothed(
    net: nn.Module, ranges: dict[tuple[int, str], torch.Tensor], alpha: float = ALPHA
) -> Iterator[nn.Module]:
    """`net` with its quantised linear layers smoothed, for the time of the block (to
    convert it); its own layers back afterwards."""
    swapped: list[tuple[nn.Module, str, nn.Linear]] = []
    try:
        for parent, name, linear in _linears(net):
            activation = ranges.get((id(parent), name))
            if activation is None:  # not on the path the calibration took
                continue
            setattr(parent, name, SmoothedLinear(linear, scales(activation, linear.weight, alpha)))
            swapped.append((parent, name, linear))
        yield net
    finally:
        for parent, name, linear in swapped:
            setattr(parent, name, linear)
