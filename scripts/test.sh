#!/usr/bin/env bash
# The README's second command: set up everything the tests need (.venv, the real
# Kafka broker), then run the whole test suite. Extra arguments go to pytest.
#
#   scripts/test.sh                 # everything
#   scripts/test.sh -m "not slow"   # skip the crash loops and memory runs
set -euo pipefail
case "${1:-}" in  # before the set-up: --help must not start it
  -h|--help) echo "usage: $0 [PYTEST ARGUMENTS...]"; sed -n '2,/^set -/s/^# \{0,1\}//p' "$0"; exit 0 ;;
esac
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
scripts/setup.sh
# The embedding cache's shared tier; its tests skip (saying why) if it cannot start.
scripts/dev-redis.sh start || echo "test.sh: no local Redis; the redis tests will be skipped" >&2
scripts/prom-tools.sh >/dev/null || echo "test.sh: no promtool/amtool; the rules' unit tests will be skipped" >&2
.venv/bin/ruff check pipeline consumers sinks scripts tests
# Offline by design: the model comes from site-packages, never from a hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest "$@"
