#!/usr/bin/env bash
# The embedding path alone on a CUDA GPU, in a few minutes: texts/s, tokens/s and
# model FLOP utilisation at bf16 and fp16, exact against bucketed pass shapes, the
# quality gate against fp32, and FAISS on the GPU when faiss-gpu is installed.
# Needs torch, transformers and numpy only: no Kafka, no Java, no network.
#
#   scripts/gpu-check.sh                       # the packaged default model
#   scripts/gpu-check.sh --model /models/bge   # any local Hugging Face directory
#   scripts/gpu-check.sh --json gpu.json
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PYTHON" "$REPO/scripts/gpu_check.py" "$@"
