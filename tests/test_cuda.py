"""The CUDA path. Runs where torch sees a GPU; elsewhere only the refusal is checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.core.corpus import sample_texts
from pipeline.core.errors import ModelError
from pipeline.model.embedder import Embedder, pick_device
from pipeline.model.precision import candidates_for, cosine_rows, neighbour_recall

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_asking_for_cuda_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(ModelError, match="no CUDA GPU"):
        pick_device("cuda")
    assert pick_device("auto") == "cpu"


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_vectors_match_cpu_fp32(embedder: Embedder, precision: str) -> None:
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    texts = sample_texts(256)
    gpu = Embedder.load("default", precision, "cuda")
    reference, vectors = embedder.embed(texts), gpu.embed(texts)
    assert gpu.info.device == "cuda"
    assert cosine_rows(reference, vectors).mean() >= 0.995
    assert neighbour_recall(reference, vectors) >= 0.95


@pytest.mark.cuda
@needs_cuda
def test_auto_precision_candidates_on_cuda_are_half_precisions() -> None:
    assert set(candidates_for("cuda")) <= {"bf16", "fp16"}
    assert pick_device("auto") == "cuda"


@pytest.mark.cuda
@needs_cuda
def test_faiss_gpu_search_matches_cpu_when_the_gpu_build_is_installed() -> None:
    faiss = pytest.importorskip("faiss")
    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
        pytest.skip("faiss-cpu installed")
    rng = np.random.default_rng(0)
    data = rng.standard_normal((2000, 384)).astype(np.float32)
    data /= np.linalg.norm(data, axis=1, keepdims=True)
    cpu = faiss.IndexFlatIP(384)
    cpu.add(data)
    gpu = faiss.index_cpu_to_all_gpus(cpu)
    _, cpu_ids = cpu.search(data[:50], 10)
    _, gpu_ids = gpu.search(data[:50], 10)
    assert (cpu_ids == gpu_ids).mean() > 0.99
