#!/usr/bin/env python
"""Small random BERTs, saved as Hugging Face folders that `pipeline run --model PATH` loads.

The chaos harness (scripts/chaos) and slow tests need a model that embeds in
microseconds on a CPU, so that their runs are dominated by Kafka and by the
worker's own protocol, not by matrix products. The vectors mean nothing; they
are deterministic (fixed seed), mean-pooled and L2-normalised.

Four variants:
- `tiny` (default): 32 dimensions, 2 layers, 128 tokens; embeds thousands of texts a second.
- `nano`: 8 dimensions, 1 layer; the model's share of a pass is close to nothing, for
  measuring the path around the model (scripts/overhead.py).
- `zero`: `nano` without any transformer layer (token embeddings, their layer norm and
  mean pooling): the model's real code path at the least cost it can have, a few
  µs a text (one layer of `nano` costs 15-20 µs of CPU a text: attention and layer
  norms over every token).
- `slow`: 128 dimensions, 4 layers, 512 tokens; on long texts a micro-batch takes
  seconds, so that rebalances find batches in flight (the revoke wait, dropped batches).

The tokenizer files are copied from the installed default model package, so the
tokenizer is the real one (fast, Rust) with the same vocabulary.

    .venv/bin/python scripts/tiny_model.py [DIR] [--slow | --nano | --zero]     # prints the folder

Built once and cached (default ~/.cache/embedding-pipeline/tiny-model[-slow]); a build
is written to a temp folder and renamed into place, so concurrent builders are safe.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Recipe:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_seq_length: int
    version: str  # bump to rebuild cached copies when the recipe changes


RECIPES = {
    "tiny": Recipe(hidden=32, layers=2, heads=2, intermediate=64, max_seq_length=128, version="1"),
    "nano": Recipe(hidden=8, layers=1, heads=1, intermediate=8, max_seq_length=128, version="1"),
    "zero": Recipe(hidden=8, layers=0, heads=1, intermediate=8, max_seq_length=128, version="1"),
    "slow": Recipe(
        hidden=128, layers=4, heads=4, intermediate=512, max_seq_length=512, version="slow-3"
    ),
}
MAX_POSITIONS = 512
SEED = 1234
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
MARKER = ".tiny-model-complete"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))) / "embedding-pipeline"
_ST = "sentence_transformers.models."
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": _ST + "Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": _ST + "Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": _ST + "Normalize"},
]


def default_dir(variant: str = "tiny") -> Path:
    return CACHE / ("tiny-model" if variant == "tiny" else f"tiny-model-{variant}")


def _is_complete(directory: Path, recipe: Recipe) -> bool:
    marker = directory / MARKER
    return marker.is_file() and marker.read_text().strip() == recipe.version


def _default_model_dir() -> Path:
    from pipeline.model.spec import resolve_model_path

    return resolve_model_path("default")[1]


def _vocab_size(source: Path) -> int:
    config = json.loads((source / "config.json").read_text())
    return int(config["vocab_size"])


def _write_json(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2) + "\n")


def _save_weights(target: Path, vocab_size: int, recipe: Recipe) -> None:
    import torch
    from transformers import BertConfig, BertModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(SEED)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden,
        num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads,
        intermediate_size=recipe.intermediate,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=0,
    )
    model = BertModel(config)
    model.eval()
    model.save_pretrained(str(target), safe_serialization=True)


def _pooling(recipe: Recipe) -> dict[str, object]:
    return {
        "word_embedding_dimension": recipe.hidden,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }


def _build(target: Path, recipe: Recipe) -> None:
    source = _default_model_dir()
    for name in TOKENIZER_FILES:
        shutil.copy2(source / name, target / name)
    _save_weights(target, _vocab_size(source), recipe)
    _write_json(target / "modules.json", MODULES)
    _write_json(target / "1_Pooling" / "config.json", _pooling(recipe))
    _write_json(target / "2_Normalize" / "config.json", {})
    _write_json(
        target / "sentence_bert_config.json",
        {"max_seq_length": recipe.max_seq_length, "do_lower_case": False},
    )
    if not (target / "model.safetensors").is_file():
        raise RuntimeError(f"no model.safetensors written in {target}")
    (target / MARKER).write_text(recipe.version + "\n")


def ensure_tiny_model(directory: Path | str | None = None, variant: str = "tiny") -> Path:
    """Returns the folder of the model, building it there first if needed."""
    recipe = RECIPES[variant]
    target = Path(directory).expanduser() if directory else default_dir(variant)
    if _is_complete(target, recipe):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(0o755)
    try:
        _build(staging, recipe)
        if target.exists() and not _is_complete(target, recipe):
            shutil.rmtree(target, ignore_errors=True)  # a half-built or outdated copy
        try:
            os.rename(staging, target)
        except OSError:
            if not _is_complete(target, recipe):  # another builder won with a good copy
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Prints the model's folder."
    )
    parser.add_argument(
        "directory",
        nargs="?",
        type=Path,
        default=None,
        help="where to build it [default: ~/.cache/embedding-pipeline/tiny-model[-VARIANT]]",
    )
    variants = parser.add_mutually_exclusive_group()
    for name, recipe in RECIPES.items():
        variants.add_argument(
            f"--{name}",
            dest="variant",
            action="store_const",
            const=name,
            help=f"{recipe.hidden} dimensions, {recipe.layers} layer(s), "
            f"{recipe.max_seq_length} tokens" + (" [the default]" if name == "tiny" else ""),
        )
    parser.set_defaults(variant="tiny")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(ensure_tiny_model(args.directory, args.variant))
    return 0


if __name__ == "__main__":
    sys.exit(main())
