"""The Transformer module's network: the native BERT-family encoder, or transformers'.

BERT, RoBERTa and XLM-R folders run on pipeline.model.bert (seconds less start-up, less
Python per pass); every other architecture on transformers' AutoModel, as
sentence-transformers loads it: encoder-decoder models (T5 and its kin) through
their encoder alone, decoder-only embedders as they are. Weights come from
safetensors only and code from a model folder is never run.

The pipeline pads every row on the right. A model whose outputs for a text's real
tokens change with the padding beside them (one that ignores the attention mask,
or sentence-transformers' left padding with absolute positions) would make vectors
that depend on the batch; a probe at load refuses such a model. So does a network
whose hidden states are not as wide as the module stack was read for: refused at
load, not at the first batch.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from pipeline.core.errors import ModelError
from pipeline.model import bert
from pipeline.model.spec import ModelSpec

log = logging.getLogger(__name__)

NATIVE, TRANSFORMERS = "native", "transformers"
# sentence-transformers loads these encoder-decoder models through their encoder.
ENCODER_ONLY = {
    "t5": "T5EncoderModel",
    "mt5": "MT5EncoderModel",
    "umt5": "UMT5EncoderModel",
    "longt5": "LongT5EncoderModel",
}
# Texts of the padding probe: the short one padded beside the long one.
_PROBE = ("a short probe", "a longer probe text, so that the short one is padded beside it " * 3)
_PROBE_MIN_COSINE = 0.99999


def native_applies(spec: ModelSpec) -> str | None:
    """Why the native encoder does not run this model (None: it does, weights permitting)."""
    transformer = spec.stack.transformer
    if transformer.kwargs("model_kwargs") or transformer.kwargs("config_kwargs"):
        return "the model passes arguments to transformers (model_args / config_args)"
    try:
        bert.read_config(transformer.directory)
    except bert.Unsupported as why:
        return str(why)
    return None


def load(spec: ModelSpec, choice: str) -> tuple[Any, str]:
    """(the network in eval mode, fp32 on the CPU; NATIVE or TRANSFORMERS).
    `choice`: "auto", "native" (or a ModelError) or "transformers"."""
    net, used = _load(spec, choice)
    _check_width(_width(net, used == NATIVE, spec), spec)
    return net, used


def _load(spec: ModelSpec, choice: str) -> tuple[Any, str]:
    if choice != TRANSFORMERS:
        why = native_applies(spec)
        if why is None:
            try:
                return bert.load_encoder(spec.stack.transformer.directory), NATIVE
            except bert.Unsupported as exc:
                why = str(exc)
                # Damaged weights of a supported type deserve a warning: transformers
                # loads them, initialising what is missing at random (and says so).
                if isinstance(exc, bert.Incomplete):
                    log.warning("model %s: %s", spec.path, exc)
            except Exception as exc:  # safetensors raises its own error classes
                raise ModelError(f"cannot load model from {spec.path}: {exc}") from exc
        if choice == NATIVE:
            raise ModelError(f"the native encoder cannot run {spec.path}: {why}")
        log.info("model %s: transformers' implementation (%s)", spec.path, why)
    net = _load_transformers(spec)
    _check_padding(net, spec)
    return net, TRANSFORMERS


def _load_transformers(spec: ModelSpec) -> Any:
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    transformer = spec.stack.transformer
    directory = str(transformer.directory)
    try:
        config = transformers.AutoConfig.from_pretrained(
            directory, trust_remote_code=False, **transformer.kwargs("config_kwargs")
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(_refusal(spec, exc)) from exc
    loader: Any = transformers.AutoModel
    encoder_only = ENCODER_ONLY.get(config.model_type)
    if encoder_only is not None:
        loader = getattr(transformers, encoder_only)
    elif getattr(config, "is_encoder_decoder", False):
        raise ModelError(
            f"model {spec.path}: encoder-decoder type {config.model_type!r} is not run by "
            f"the pipeline (it runs the encoders of {', '.join(sorted(ENCODER_ONLY))})"
        )
    # Its load report lists a task head's unused weights as "unexpected": not ours to
    # act on. Missing weights are, and are refused below.
    hf_logging.set_verbosity_error()
    try:
        net, loading = loader.from_pretrained(
            directory,
            config=config,
            use_safetensors=True,
            trust_remote_code=False,
            dtype=torch.float32,
            output_loading_info=True,
            **transformer.kwargs("model_kwargs"),
        )
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise ModelError(_refusal(spec, exc)) from exc
    missing = sorted(k for k in loading.get("missing_keys", ()) if not k.startswith("pooler."))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelError(
            f"model {spec.path}: its weights lack {', '.join(missing[:3])}{more}; transformers "
            "would initialise them at random, so no two loads would give the same vectors"
        )
    return net.eval()


def _width(net: Any, native: bool, spec: ModelSpec) -> int:
    """The width of the network's hidden states: the native encoder's config (its own
    code), one short pass of transformers' (whose config may name another width)."""
    if native:
        return int(net.config.hidden_size)
    ids = spec.tokenizer.backend(spec.max_length).encode(_PROBE[0]).ids
    with torch.inference_mode():
        hidden = forward(net, False, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    return int(hidden.shape[-1])


def _check_width(width: int, spec: ModelSpec) -> None:
    """Refuses a network whose hidden states are not as wide as the stack was read for
    (pipeline.model.stack: the hidden size its config.json names, else its Pooling's),
    before a batch would fail on it."""
    expected = spec.stack.pooling.embedding_dimension
    if width != expected:
        raise ModelError(
            f"model {spec.path}: its transformer gives {width}-d token embeddings, but its "
            f"module stack was read for {expected}-d ones (its config.json's hidden size, "
            "else its Pooling config's): the pipeline does not know what it would pool"
        )


def _refusal(spec: ModelSpec, exc: Exception) -> str:
    raw = json.loads(spec.config)
    if raw.get("auto_map"):
        return (
            f"model {spec.path} needs code from its own folder (auto_map, trust_remote_code), "
            f"which the pipeline never runs: {str(exc).splitlines()[0]}"
        )
    return f"cannot load model from {spec.path}: {str(exc).splitlines()[0]}"


def forward(net: Any, native: bool, input_ids: Any, mask: Any, padded: bool = True) -> Any:
    """The last hidden state of right-padded rows (`padded` False: no row is padded)."""
    if native:
        # No mask at all where no row is padded: attention then skips the masking work.
        return net(input_ids, mask if padded else None)
    return net(input_ids=input_ids, attention_mask=mask).last_hidden_state


def _check_padding(net: Any, spec: ModelSpec) -> None:
    """Refuses a model whose real tokens' outputs change with padding beside them:
    on the right (as the pipeline pads) or on sentence-transformers' side."""
    tokenizer = spec.tokenizer.backend(spec.max_length)
    short, long = (e.ids for e in tokenizer.encode_batch(list(_PROBE)))
    n, width = len(short), len(long)
    if n >= width:
        return
    pad = spec.tokenizer.pad_token_id or 0
    with torch.inference_mode():
        alone = forward(net, False, torch.tensor([short]), torch.ones(1, n, dtype=torch.long))[0]
        sides = ["right"] + (["left"] if spec.tokenizer.padding_side == "left" else [])
        for side in sides:
            fill = [pad] * (width - n)
            row = short + fill if side == "right" else fill + short
            real = [1] * n + [0] * (width - n) if side == "right" else [0] * (width - n) + [1] * n
            ids = torch.tensor([row, long])
            mask = torch.tensor([real, [1] * width])
            hidden = forward(net, False, ids, mask)[0]
            kept = hidden[:n] if side == "right" else hidden[width - n :]
            cosine = torch.nn.functional.cosine_similarity(
                kept.flatten().float(), alone.flatten().float(), dim=0
            )
            if float(cosine) < _PROBE_MIN_COSINE:
                raise ModelError(_padding_refusal(spec, side, float(cosine)))


def _padding_refusal(spec: ModelSpec, side: str, cosine: float) -> str:
    if side == "left":
        why = (
            "sentence-transformers pads it on the left, and its outputs then depend on how "
            "much padding a batch has (absolute positions), so no vector of one text is "
            "its alone"
        )
    else:
        why = "its outputs change with padding on the right (it does not honour the mask)"
    return (
        f"model {spec.path} ({spec.architecture}): {why} (cosine {cosine:.5f} against the text "
        "alone); the pipeline would write vectors that differ from sentence-transformers'"
    )
