#!/usr/bin/env bash
# The README's first command: from a fresh clone, set up, publish a sample corpus
# of real text, embed it to the end, show the lag report and a search result.
#
#   scripts/demo.sh [NUMBER_OF_PARAGRAPHS]      (default 2000)
set -euo pipefail
case "${1:-}" in  # before any step: --help must not start one
  -h|--help) echo "usage: $0 [NUMBER_OF_PARAGRAPHS]"; sed -n '2,/^set -/s/^# \{0,1\}//p' "$0"; exit 0 ;;
  ""|*[!0-9]*) [[ -z "${1:-}" ]] || { echo "usage: $0 [NUMBER_OF_PARAGRAPHS]" >&2; exit 2; } ;;
esac
[[ $# -le 1 ]] || { echo "usage: $0 [NUMBER_OF_PARAGRAPHS]" >&2; exit 2; }
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

LIMIT="${1:-2000}"
RUN="demo-$(date +%s)"
TOPIC="demo-corpus-$RUN"
GROUP="demo-embedders-$RUN"
WORK="$REPO/demo-out/$RUN"
P=.venv/bin/pipeline
mkdir -p "$WORK"

step() { printf '\n== %s\n' "$*"; }

step "building a corpus of $LIMIT real paragraphs (Python standard library docstrings)"
.venv/bin/python scripts/make_corpus.py --limit "$LIMIT" --out "$WORK/corpus.jsonl"

step "creating topic $TOPIC"
$P topics create "$TOPIC" --partitions 3

step "publishing the corpus"
$P produce "$TOPIC" "$WORK/corpus.jsonl"

step "embedding to the end (pipeline run --until-end)"
$P --log-level WARNING run --topic "$TOPIC" --group "$GROUP" --output "$WORK/out" --until-end

step "pipeline status"
$P status --group "$GROUP" --output "$WORK/out" || true

step "pipeline search 'compress data with gzip'"
$P search --output "$WORK/out" -k 3 "compress data with gzip"

printf '\nOutputs in %s (Parquet under vectors/, FAISS under index/).\n' "$WORK/out"
