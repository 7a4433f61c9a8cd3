"""The embedding model: tokenizer + transformer + head, with length-aware batching.

What runs is what sentence-transformers runs for the model (pipeline.model.spec):
its tokenizer as transformers builds it, its Transformer module on the native
BERT-family encoder or transformers' (pipeline.model.network), and the modules
after it, pooling to truncation (pipeline.model.head). Weights are loaded from
safetensors only and code from a model folder is never run.

The hot path works on whole batches: the Rust tokenizer over a micro-batch (in
chunks on several threads when it is large), numpy for sorting and padding, and
forward passes over sub-batches of similar lengths whose padded size (rows x
width) stays under a token budget, so that padding is a small share of the
computed tokens. Pass shapes come from a bounded set (pipeline.model.shapes).

On the CPU the passes of a batch run on several model replicas at once: threads
sharing one set of weights, each running its passes with a small OpenMP team (one
thread by default). A multi-threaded pass stalls at every barrier when another
process holds one of its cores; independent single-threaded passes do not, and
they spend no time on small passes' fork/join. `plan_cpu` sizes both from the
CPUs this process may really use (pipeline.core.host). On OpenVINO (int8) each
replica is a process with one stream of its own (pipeline.model.openvino_engine),
its replica thread here handing it passes.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.core.errors import ModelError
from pipeline.core.host import CpuPlan, release_free_memory
from pipeline.core.model_info import ModelInfo
from pipeline.model.shapes import Pass, ShapePlan, pass_defaults
from pipeline.model.spec import ModelSpec
from pipeline.model.tokenize import batches, fast_path
from pipeline.model.tokenize.wordpiece import FastWordPiece

if TYPE_CHECKING:
    from pipeline.model.head import Head

log = logging.getLogger(__name__)

# Texts per tokenizer call when a batch is tokenized on several threads.
TOKENIZE_CHUNK = 512
# On the CPU, free pages go back to the OS after a pass whose widest activation
# reached this size: after every pass of a tiny model, the trim cost more than the pass.
TRIM_AFTER_BYTES = 2 << 20
# Which implementation runs the model: "auto" (pipeline.model.bert for the BERT family,
# transformers for the rest), "native" (pipeline.model.bert or a ModelError) or
# "transformers" (to compare against, or to step around pipeline.model.bert).
ENCODER_ENV = "PIPELINE_ENCODER"
ENCODERS = ("auto", "native", "transformers")
# Which tokenizer serves texts on the CPU: "auto" (pipeline.model.tokenize.wordpiece where the
# model's tokenizer is BERT's WordPiece and the check at load agrees) or "rust"
# (the Rust tokenizer for every text, to compare against).
TOKENIZER_ENV = "PIPELINE_TOKENIZER"
TOKENIZERS = ("auto", "rust")


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
    seconds: float = 0.0  # embedding this batch, less `yielded_s`
    yielded_s: float = 0.0  # spent in `between_passes`, on other work

    @property
    def padding_efficiency(self) -> float:
        return self.real_tokens / self.computed_tokens if self.computed_tokens else 1.0


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
        spec: ModelSpec,
        model: Any,
        encoder: str,
        info: ModelInfo,
        sub_batch_tokens: int | None,
        replicas: int = 1,
        threads_per_replica: int | None = None,
        tokenizer_threads: int | None = None,
        head: Head | None = None,
    ) -> None:
        """`sub_batch_tokens` None: the device's and model's default (pass_defaults)."""
        # Imported here: torch's import is seconds, and the batcher and the worker's
        # other parts import this module for its types.
        from pipeline.model import network
        from pipeline.model.head import Head

        self.spec = spec
        self._fast = spec.tokenizer.backend(spec.max_length)  # truncates, never pads
        self._pad_id = spec.tokenizer.pad_token_id or 0
        self.engine = info.engine
        if self.engine == "openvino":
            # Compiled for this layout: several replicas are a process each.
            model = model.compile(replicas, threads_per_replica)
        self._model = model
        self.encoder = encoder
        self._native = encoder == network.NATIVE
        self._network = network.forward
        self._head = (
            head if head is not None else Head(spec.stack, spec.truncate_dim).to(info.device)
        )
        self.info = info
        self._activation_bytes_per_token = activation_bytes_per_token(model)
        budget, self.padding_target = pass_defaults(info.device, self._activation_bytes_per_token)
        self.sub_batch_tokens = sub_batch_tokens or budget
        self.replicas = replicas
        self._threads_per_replica = threads_per_replica
        self.exact_shapes = False  # True only to measure what bucketed shapes save
        # Tokenizing runs on the poll thread's critical path: one core's worth of it
        # was the worker's ceiling with a fast model (and is a GPU's).
        self.tokenizer_threads = max(1, tokenizer_threads or replicas * (threads_per_replica or 1))
        self._tokenizers: ThreadPoolExecutor | None = None
        # On the CPU the tokenizer takes cores from the model: the fast path
        # (pipeline.model.tokenize) costs a fraction of the Rust tokenizer's CPU time
        # (docs/models.md). On CUDA the tokenizer threads are
        # the ceiling, and the Rust ones run outside the GIL, side by side.
        self._wordpiece: FastWordPiece | None = None
        if info.device == "cpu" and tokenizer_choice() == "auto":
            self._wordpiece = fast_path.for_tokenizer(self._fast, info.max_length)
            if self._wordpiece is not None:
                self._wordpiece.unicode_rules()  # at load, not at the first non-ASCII text
        # Tokens at the start of every row that pooling leaves out, per prompt
        # (sentence-transformers' include_prompt false).
        self._excluded: dict[str, int] = {}
        # Long-lived threads: each keeps its own OpenMP team (see pipeline.core.host).
        self._pool = ThreadPoolExecutor(
            max_workers=replicas,
            thread_name_prefix="embed-replica",
            initializer=_set_threads,
            initargs=(threads_per_replica,),
        )

    def with_replicas(
        self,
        replicas: int,
        threads_per_replica: int | None = None,
        tokenizer_threads: int | None = None,
    ) -> Embedder:
        """The same loaded weights, run by another number of replica threads."""
        return Embedder(
            self.spec,
            self._model,
            self.encoder,
            self.info,
            self.sub_batch_tokens,
            replicas,
            threads_per_replica,
            tokenizer_threads,
            self._head,
        )

    def close(self) -> None:
        """Ends the replica and tokenizer threads: passes not yet started are dropped
        (their batch is abandoned: nothing of it was committed), running ones finish."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._tokenizers is not None:
            self._tokenizers.shutdown(wait=True, cancel_futures=True)
        if self.engine == "openvino":
            self._model.close()  # its replica processes, if any

    def engine_cpu_seconds(self) -> float:
        """CPU seconds of the engine's processes of its own (OpenVINO's replicas)."""
        return self._model.cpu_seconds() if self.engine == "openvino" else 0.0

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
        dimensions: int | None = None,
        spec: ModelSpec | None = None,
        engine: str | None = None,
        recipe: str | None = None,
    ) -> Embedder:
        """`encoder`: "auto" (pipeline.model.bert where it applies, else transformers),
        "native" or "transformers"; None reads PIPELINE_ENCODER (default auto).
        `document_prompt` / `query_prompt`: None takes the model's own (pipeline.model.prompts),
        "" none. `dimensions`: Matryoshka truncation. `spec`: the model already read
        (pipeline.model.spec), instead of `model` and the three before. `engine`:
        "torch" or "openvino"; None: the precision's (engine_for). `recipe`: int8's
        (pipeline.model.openvino_engine.RECIPES; None: the default), as an output
        that holds int8 recorded it."""
        import torch

        from pipeline.model import network

        spec = spec or ModelSpec.read(model, document_prompt, query_prompt, dimensions)
        device = pick_device(device)
        engine = engine or engine_for(precision)
        _check_precision(precision, device, engine)
        net, used = network.load(spec, _encoder_choice(encoder))
        calibration = calibration_of(precision, engine, recipe)
        net = _apply_precision(spec, net, used, precision, device, engine, calibration)
        calibration = net.recipe.name if getattr(net, "recipe", None) else calibration  # as made
        info = spec.info(precision, device, engine, calibration)
        log.info(
            "model %s (%s) loaded: %s, %d dimensions, %s on %s (%s), %s encoder; prompts: "
            "document %r, query %r",
            spec.name,
            spec.revision,
            info.modules,
            info.dim,
            precision,
            device,
            engine,
            used,
            info.document_prompt,
            info.query_prompt,
        )
        torch.set_grad_enabled(False)
        return cls(
            spec,
            net,
            used,
            info,
            sub_batch_tokens,
            replicas,
            threads_per_replica,
            tokenizer_threads,
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
        spec: ModelSpec | None = None,
        recipe: str | None = None,
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
            spec=spec,
            recipe=recipe,
        )
        embedder.exact_shapes = exact_shapes
        return embedder

    def excluded_tokens(self, prompt: str | None = None) -> int:
        """How many tokens at the start of each row pooling leaves out for texts after
        `prompt` (None: the document prompt): the prompt's, where the model's Pooling
        excludes prompts, else none."""
        prompt = self.info.document_prompt if prompt is None else prompt
        if self.spec.stack.pooling.include_prompt or not prompt:
            return 0
        if prompt not in self._excluded:
            self._excluded[prompt] = self.spec.tokenizer.prompt_length(prompt, self.info.max_length)
        return self._excluded[prompt]

    def tokenize(self, texts: list[str], prompt: str | None = None) -> Tokenized:
        """Token ids in the texts' order, each text after `prompt` (None: the document
        prompt), so the prompt's tokens count against max_length and every budget.
        Through pipeline.model.tokenize.wordpiece where it applies (on the caller's thread), the
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
        """The Rust tokenizer, serialised (truncation included): to tokenize elsewhere,
        with `split_special_tokens`, which the serialised form leaves out."""
        return str(self._fast.to_str())

    @property
    def split_special_tokens(self) -> bool:
        return bool(self._fast.encode_special_tokens)

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
        self, texts: list[str], fast: FastWordPiece
    ) -> tuple[list[list[int]], int]:
        ids, truncated, others = batches.encode_taken(fast, texts)
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
        return self.embed_tokens(self.tokenize(texts, prompt), prompt)[0]

    def embed_queries(self, texts: list[str]) -> np.ndarray:
        """Vectors of search queries: each after the query prompt."""
        return self.embed(texts, self.info.query_prompt)

    def embed_tokens(
        self,
        tokens: Tokenized,
        prompt: str | None = None,
        between_passes: Callable[[], None] | None = None,
    ) -> tuple[np.ndarray, EmbedStats]:
        """Embeds in length order under the token budget; returns rows in input order.
        `prompt`: the one the texts were tokenized after (None: the document prompt).
        `between_passes`: called before each pass is started, at most `replicas`
        passes ahead of the last one done, so that it may run more urgent work
        meanwhile (the worker's nearline batches during a backfill batch); the time
        spent in it is not counted in the stats' seconds."""
        excluded = self.excluded_tokens(prompt)
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
            out[rows] = self._forward(flat, starts[rows], tokens.lengths[rows], one.width, excluded)
            if trim and one.computed_tokens >= trim_from:
                # A batch's passes free and allocate activations of many sizes; kept
                # by the allocator until the batch ends, they add up (docs/performance.md).
                release_free_memory()

        yielded = 0.0
        if between_passes is None:
            for done in [self._pool.submit(run, one) for one in passes]:
                done.result()
        else:
            yielded = self._run_yielding(run, passes, between_passes)
        stats.computed_tokens = sum(p.computed_tokens for p in passes)
        stats.forward_passes = len(passes)
        stats.yielded_s = yielded
        stats.seconds = time.perf_counter() - started - yielded
        return out, stats

    def _run_yielding(
        self, run: Callable[[Pass], None], passes: list[Pass], between: Callable[[], None]
    ) -> float:
        """Runs the passes with one per replica out at a time, calling `between` before
        each is submitted; returns the seconds spent in `between`."""
        out: collections.deque[Future[None]] = collections.deque()
        yielded = 0.0
        for one in passes:
            if len(out) >= self.replicas:
                out.popleft().result()
            started = time.perf_counter()
            between()
            yielded += time.perf_counter() - started
            out.append(self._pool.submit(run, one))
        for done in out:
            done.result()
        return yielded

    def _forward(
        self, flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray, width: int, excluded: int
    ) -> np.ndarray:
        """Vectors of the texts whose ids are flat[start:start + length], padded to width,
        pooling leaving out the first `excluded` tokens of each."""
        import torch

        # Gathered all at once (row-major order is the rows' order): a row at a time
        # cost a few µs of the GIL per text.
        columns = np.arange(width)
        real = columns < lengths[:, None]
        ids = np.full((len(lengths), width), self._pad_id, dtype=np.int64)
        ids[real] = flat[(starts[:, None] + columns)[real]]
        mask = real.astype(np.int64)
        input_ids, attention = torch.from_numpy(ids), torch.from_numpy(mask)
        if self.info.device == "cuda":
            input_ids = input_ids.pin_memory().to("cuda", non_blocking=True)
            attention = attention.pin_memory().to("cuda", non_blocking=True)
        with torch.inference_mode():
            if self.engine == "openvino":  # pooled in the engine's memory, copied out
                with self._model.hidden(ids, mask) as hidden:
                    return self._head(hidden, attention, excluded).numpy().copy()
            padded = bool(lengths.min() < width)
            hidden = self._network(self._model, self._native, input_ids, attention, padded)
            return self._head(hidden, attention, excluded).cpu().numpy()


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


def engine_for(precision: str) -> str:
    """The engine a precision runs on: int8 on OpenVINO (pipeline.model.openvino_engine),
    the float precisions on torch."""
    return "openvino" if precision == "int8" else "torch"


def calibration_of(precision: str, engine: str, recipe: str | None = None) -> str:
    """How the weights are made int8 ("" for float): `recipe`, or the default's name
    (which chooses one per model at load: the outputs record the one chosen)."""
    from pipeline.model import openvino_engine

    if precision != "int8" or engine != "openvino":
        return ""
    return openvino_engine.recipe_named(recipe).name if recipe else openvino_engine.RECIPE


def _check_precision(precision: str, device: str, engine: str) -> None:
    if precision == "auto":
        raise ModelError("resolve --precision auto before loading (pipeline.model.precision)")
    if engine == "openvino":
        if device != "cpu":
            raise ModelError(
                f"{precision} on OpenVINO runs on the CPU only; on CUDA use fp16 or bf16"
            )
        if precision not in ("fp32", "int8"):
            raise ModelError(f"the OpenVINO engine runs fp32 and int8, not {precision}")
        return
    if precision == "int8":
        raise ModelError("int8 runs on the OpenVINO engine, not on torch")
    if precision == "fp16" and device == "cpu":
        raise ModelError("fp16 is for CUDA; on the CPU use bf16 (where native) or fp32")


def _apply_precision(
    spec: ModelSpec,
    net: Any,
    encoder: str,
    precision: str,
    device: str,
    engine: str,
    calibration: str,
) -> Any:
    import torch

    if engine == "openvino":
        from pipeline.model import network, openvino_engine

        native = encoder == network.NATIVE
        recipe = calibration or openvino_engine.RECIPE
        return openvino_engine.load(spec, net, native, precision, recipe)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return net.to(device=device, dtype=dtype)


def cpu_has_native_bf16() -> bool:
    """True where the CPU runs bf16 matmuls natively (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
