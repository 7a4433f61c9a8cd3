"""SmoothQuant's smoothing (pipeline.model.smoothing): it moves activation range into
the weights without changing what the network computes, and leaves the network as it
was afterwards."""

from __future__ import annotations

import torch
from torch import nn

from pipeline.core.corpus import calibration_texts, sample_texts
from pipeline.model import smoothing
from pipeline.model.bert import load_encoder
from pipeline.model.spec import ModelSpec


def _batches(spec: ModelSpec, texts: list[str]) -> list[torch.Tensor]:
    tokenizer = spec.tokenizer.backend(spec.max_length)
    return [torch.tensor([e.ids]) for e in tokenizer.encode_batch(texts)]


def _unpadded(batches: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(ids, torch.ones_like(ids)) for ids in batches]


def _hidden(net: nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [net(ids, torch.ones_like(ids)) for ids in batches]


def test_a_smoothed_network_computes_the_same_hidden_states() -> None:
    spec = ModelSpec.read("default")
    net = load_encoder(spec.path)
    ranges = smoothing.input_ranges(net, net, _unpadded(_batches(spec, calibration_texts(40))))
    held_out = _batches(spec, sample_texts(12))
    before = _hidden(net, held_out)
    with smoothing.smoothed(net, ranges) as ready:
        smoothed = [m for m in ready.modules() if isinstance(m, smoothing.SmoothedLinear)]
        # qkv, attention output and the up-projection of each layer; not the
        # down-projection, which reads 4x the values it writes.
        assert len(smoothed) == 3 * len(net.layers)
        assert all(isinstance(layer.output, nn.Linear) for layer in net.layers)
        after = _hidden(ready, held_out)
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    assert not [m for m in net.modules() if isinstance(m, smoothing.SmoothedLinear)]
    torch.testing.assert_close(_hidden(net, held_out)[0], before[0], atol=0, rtol=0)


def test_the_scales_balance_activation_and_weight_ranges() -> None:
    """At alpha 0.5 a channel's activation range and its weight column's range meet:
    each is the geometric mean of the two before. A channel never active keeps 1."""
    torch.manual_seed(0)
    linear = nn.Linear(4, 6)
    activation = torch.tensor([40.0, 0.5, 2.0, 0.0])
    scale = smoothing.scales(activation, linear.weight, alpha=0.5)
    weight_range = linear.weight.abs().amax(0)
    torch.testing.assert_close(activation[:3] / scale[:3], weight_range[:3] * scale[:3])
    assert scale[3] == 1.0
    smoothed = smoothing.SmoothedLinear(linear, scale)
    x = torch.randn(5, 4)
    torch.testing.assert_close(smoothed(x), linear(x))


def test_padding_is_left_out_of_the_ranges() -> None:
    """A padded batch gives the ranges of its texts passed one by one: a pad token's
    values are not text's."""
    spec = ModelSpec.read("default")
    net = load_encoder(spec.path)
    rows = [b[0].tolist() for b in _batches(spec, sample_texts(6))]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    padded = smoothing.input_ranges(net, net, [(ids, mask)])
    alone = smoothing.input_ranges(net, net, _unpadded([torch.tensor([r]) for r in rows]))
    assert padded.keys() == alone.keys()
    for key, seen in alone.items():
        torch.testing.assert_close(padded[key], seen, atol=1e-4, rtol=1e-4)
