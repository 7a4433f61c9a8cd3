#!/usr/bin/env bash
# The README's second command: set up everything the tests need (.venv, the real
# Kafka broker), then run the whole test suite. Extra arguments go to pytest.
#
#   scripts/test.sh                 # everything
#   scripts/test.sh -m "not slow"   # skip the crash loops and memory runs
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
scripts/setup.sh
# The embedding cache's shared tier; its tests skip (saying why) if it cannot start.
scripts/dev-redis.sh start || echo "test.sh: no local Redis; the redis tests will be skipped" >&2
.venv/bin/ruff check pipeline consumers sinks scripts tests
# Offline by design: the model comes from site-packages, never from a hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest "$@"
