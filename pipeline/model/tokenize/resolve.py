"""The model's tokenizer, as transformers builds it, without importing transformers twice.

sentence-transformers tokenizes with `AutoProcessor.from_pretrained(folder, **kwargs)`:
a transformers tokenizer class, which in transformers 5 rebuilds parts of the Rust
pipeline from its own settings (BERT's normaliser from `do_lower_case`, for one),
so `tokenizer.json` alone is not what runs. This module asks transformers once,
applies what sentence-transformers changes (`max_seq_length`, the length cap at
the model's positions, `do_lower_case` as a Lowercase normaliser in front) and
keeps the resulting Rust tokenizer serialised with what the pipeline needs of the
Python side (pad id, special ids, sides, length limit).

Importing transformers' tokenizers costs seconds of a worker's start-up, so the
result is cached on disk under a key of everything it depends on (the folder's
configuration and vocabulary files, the transformers and tokenizers versions, the
sentence-transformers settings): a later start reads one JSON file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline.core.errors import ModelError
from pipeline.model.stack import TransformerModule

log = logging.getLogger(__name__)

# Where what is read from model folders is kept (resolved tokenizers, weights hashes).
CACHE_ENV = "PIPELINE_MODEL_METADATA_CACHE"
_FORMAT = "1"
# Files that do not shape the tokenizer or the configs: weights, and what sits beside them.
_NOT_CONFIG = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".onnx", ".msgpack", ".gguf", ".md")
# Above this, a file is weights or data, not a tokenizer's configuration.
_MAX_CONFIG_BYTES = 64 << 20
# transformers' "no limit" (VERY_LARGE_INTEGER) and the threshold it tests against.
_UNLIMITED = int(1e30)
_LARGE = int(1e20)


@dataclass(frozen=True)
class ResolvedTokenizer:
    """A tokenizer as transformers and sentence-transformers would run it."""

    backend_json: str  # the Rust tokenizer, without truncation or padding
    pad_token_id: int | None
    special_ids: tuple[int, ...]
    model_max_length: int  # after sentence-transformers' adjustments; _UNLIMITED when none
    padding_side: str
    truncation_side: str
    split_special_tokens: bool
    files_hash: str  # of the folder's configuration and vocabulary files

    @property
    def limited(self) -> bool:
        return self.model_max_length < _LARGE

    def backend(self, max_length: int | None) -> Any:
        """A fresh Rust tokenizer that truncates at `max_length` (None: never) and never pads."""
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(self.backend_json)
        tokenizer.no_padding()
        if max_length is None:
            tokenizer.no_truncation()
        else:
            tokenizer.enable_truncation(max_length, direction=self.truncation_side)
        tokenizer.encode_special_tokens = self.split_special_tokens
        return tokenizer

    def prompt_length(self, prompt: str, max_length: int | None) -> int:
        """The tokens a prompt takes at the start of a text, as sentence-transformers
        counts them to exclude a prompt from pooling: the prompt tokenized alone, less a
        trailing special token."""
        if not prompt:
            return 0
        ids = self.backend(max_length).encode(prompt).ids
        return len(ids) - 1 if ids and ids[-1] in self.special_ids else len(ids)


def resolve(module: TransformerModule, max_positions: int | None) -> ResolvedTokenizer:
    """The tokenizer of `module`'s folder; `max_positions` is the model config's
    max_position_embeddings (None or -1: none), which caps the length limit as
    sentence-transformers caps it."""
    files = files_hash(module.directory)
    key = _cache_key(module, max_positions, files)
    cached = _read_cache(key)
    if cached is not None:
        return cached
    resolved = _from_transformers(module, max_positions, files)
    _write_cache(key, resolved)
    return resolved


def files_hash(directory: Path) -> str:
    """A hash of the folder's configuration and vocabulary files (not its weights)."""
    digest = hashlib.sha256()
    for file in sorted(directory.iterdir()):
        if not file.is_file() or file.name.endswith(_NOT_CONFIG):
            continue
        size = file.stat().st_size
        if size > _MAX_CONFIG_BYTES:
            continue
        digest.update(f"{file.name}\0{size}\0".encode())
        digest.update(file.read_bytes())
    return "sha256:" + digest.hexdigest()[:16]


def _cache_key(module: TransformerModule, max_positions: int | None, files: str) -> str:
    parts = {
        "format": _FORMAT,
        "transformers": _version("transformers"),
        "tokenizers": _version("tokenizers"),
        "files": files,
        "max_seq_length": module.max_seq_length,
        "do_lower_case": module.do_lower_case,
        "processor_kwargs": module.processor_kwargs,
        "max_positions": max_positions,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _from_transformers(
    module: TransformerModule, max_positions: int | None, files: str
) -> ResolvedTokenizer:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    kwargs = module.kwargs("processor_kwargs")
    if module.max_seq_length is not None and "model_max_length" not in kwargs:
        kwargs["model_max_length"] = module.max_seq_length
    for name in ("preprocessor_config.json", "processor_config.json"):
        if (module.directory / name).is_file():
            raise ModelError(
                f"model {module.directory} has a {name}: a multimodal processor, which the "
                "pipeline does not run"
            )
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(module.directory), trust_remote_code=False, **kwargs
        )
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ModelError(f"cannot load the tokenizer of {module.directory}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False) or not hasattr(tokenizer, "backend_tokenizer"):
        raise ModelError(
            f"model {module.directory}: its tokenizer ({type(tokenizer).__name__}) has no Rust "
            "(fast) implementation; the pipeline needs one (tokenizer.json)"
        )
    limit = int(tokenizer.model_max_length)
    if "model_max_length" not in kwargs and max_positions not in (None, -1):
        limit = min(limit, int(max_positions))
    backend = tokenizer.backend_tokenizer
    if module.do_lower_case:
        backend = _lowercased(backend)
    serialised = json.loads(backend.to_str())
    serialised["truncation"] = serialised["padding"] = None
    return ResolvedTokenizer(
        backend_json=json.dumps(serialised, ensure_ascii=False),
        pad_token_id=tokenizer.pad_token_id,
        special_ids=tuple(sorted(int(i) for i in tokenizer.all_special_ids)),
        model_max_length=limit,
        padding_side=str(tokenizer.padding_side),
        truncation_side=str(tokenizer.truncation_side),
        split_special_tokens=bool(getattr(tokenizer, "split_special_tokens", False)),
        files_hash=files,
    )


def _lowercased(backend: Any) -> Any:
    """sentence-transformers' do_lower_case: a Lowercase normaliser in front, unless
    one is there already (a BERT normaliser that lower-cases does not count)."""
    from tokenizers import Tokenizer, normalizers

    copy = Tokenizer.from_str(backend.to_str())
    current = copy.normalizer
    if isinstance(current, normalizers.Lowercase):
        return copy
    if isinstance(current, normalizers.Sequence):
        inner = json.loads(copy.to_str())["normalizer"]["normalizers"]
        if any(step.get("type") == "Lowercase" for step in inner):
            return copy
        copy.normalizer = normalizers.Sequence([normalizers.Lowercase(), *current])
    elif current is None:
        copy.normalizer = normalizers.Lowercase()
    else:
        copy.normalizer = normalizers.Sequence([normalizers.Lowercase(), current])
    return copy


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def metadata_dir() -> Path:
    """$PIPELINE_MODEL_METADATA_CACHE, else the user's cache."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "embedding-pipeline" / "model-metadata"


def cache_dir() -> Path:
    return metadata_dir() / "tokenizers"


def _read_cache(key: str) -> ResolvedTokenizer | None:
    path = cache_dir() / f"{key}.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        raw["special_ids"] = tuple(raw["special_ids"])
        return ResolvedTokenizer(**raw)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:  # a cache: resolve again
        log.debug("tokenizer cache %s unreadable (%s): resolving again", path, exc)
        return None


def _write_cache(key: str, resolved: ResolvedTokenizer) -> None:
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(asdict(resolved)), encoding="utf-8")
        os.replace(tmp, directory / f"{key}.json")
    except OSError as exc:
        log.debug("could not cache the resolved tokenizer in %s: %s", directory, exc)
