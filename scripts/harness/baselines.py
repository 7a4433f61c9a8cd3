"""The baselines a benchmark compares the pipeline with: sentence-transformers'
`encode`, and the consumer a user writes from a model card (kafka-python, polls of
32 embedded in arrival order at fp32 with transformers, a Parquet file and a commit
per batch)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from harness import HarnessError
from harness.numbers import Padding, Rate, Timer
from pipeline.core.config import KafkaSettings
from pipeline.model.spec import ModelSpec

NAIVE_BATCH = 32
ST_BATCH = 32
WARMUP_TEXTS = 32
NAIVE_IDLE_TIMEOUT_S = 120.0


def bench_sentence_transformers(
    model_dir: Path, device: str, texts: list[str]
) -> tuple[Rate, np.ndarray, Timer]:
    """(b)'s rate and vectors, and its Timer (the model loaded) to time it again."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device=device)
    model.encode(texts[:WARMUP_TEXTS], batch_size=ST_BATCH, show_progress_bar=False)
    name = f"(b) sentence-transformers encode(batch_size={ST_BATCH}), fp32"
    timer = Timer(
        "b",
        name,
        len(texts),
        lambda: model.encode(texts, batch_size=ST_BATCH, show_progress_bar=False),
    )
    rate, vectors = timer.timed()
    return rate, np.asarray(vectors, dtype=np.float32), timer


# -- (c) the naive consumer ----------------------------------------------------------


class NaiveModel:
    """What a user writes from the model card: fp32, pad per batch, mean pool, L2."""

    def __init__(self, model_dir: Path, device: str) -> None:
        from transformers import AutoModel, AutoTokenizer

        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModel.from_pretrained(str(model_dir)).to(device).eval()
        self.max_length = ModelSpec.read(str(model_dir)).max_length
        self.real_tokens = 0
        self.computed_tokens = 0

    def embed(self, texts: list[str]) -> np.ndarray:
        import torch

        batch = self.tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        ).to(self.device)
        mask = batch["attention_mask"]
        self.real_tokens += int(mask.sum())
        self.computed_tokens += mask.numel()
        with torch.no_grad():
            hidden = self.model(**batch).last_hidden_state
            weights = mask.unsqueeze(-1).float()
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.cpu().numpy()


def write_naive_parquet(path: Path, ids: list[str], texts: list[str], vectors: np.ndarray) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    flat = pa.array(vectors.astype(np.float32, copy=False).ravel())
    table = pa.table(
        {
            "id": pa.array(ids, pa.string()),
            "text": pa.array(texts, pa.string()),
            "embedding": pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1]),
        }
    )
    pq.write_table(table, path)


def bench_naive(
    kafka: KafkaSettings,
    topic: str,
    group: str,
    naive: NaiveModel,
    expected: int,
    output: Path,
    warmup: list[str],
) -> tuple[Rate, Padding]:
    from kafka import KafkaConsumer

    naive.embed(warmup)
    naive.real_tokens = naive.computed_tokens = 0
    output.mkdir(parents=True)
    started = time.perf_counter()
    consumer = KafkaConsumer(
        topic,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_records=NAIVE_BATCH,
        **kafka.client_kwargs(),
    )
    try:
        consumed = _naive_loop(consumer, naive, expected, output)
    finally:
        consumer.close(autocommit=False)
    seconds = time.perf_counter() - started
    name = f"(c) naive consumer: polls of {NAIVE_BATCH}, arrival order, fp32, Parquet+commit"
    padding = Padding(
        f"(c) arrival order, polled batches of {NAIVE_BATCH} (measured)",
        naive.real_tokens,
        naive.computed_tokens,
    )
    return Rate.timed("c", name, consumed, seconds), padding


def _naive_loop(consumer: Any, naive: NaiveModel, expected: int, output: Path) -> int:
    consumed, batch_no, last_data = 0, 0, time.monotonic()
    while consumed < expected:
        polled = consumer.poll(timeout_ms=1000)
        records = [r for batch in polled.values() for r in batch]
        if not records:
            if time.monotonic() - last_data > NAIVE_IDLE_TIMEOUT_S:
                raise HarnessError(f"(c) got nothing for {NAIVE_IDLE_TIMEOUT_S:.0f}s at {consumed}")
            continue
        last_data = time.monotonic()
        values = [json.loads(r.value) for r in records]
        texts = [v["text"] for v in values]
        vectors = naive.embed(texts)
        path = output / f"batch-{batch_no:06d}.parquet"
        write_naive_parquet(path, [v["id"] for v in values], texts, vectors)
        consumer.commit()
        consumed += len(records)
        batch_no += 1
    return consumed


# -- (d) pipeline run ----------------------------------------------------------------
