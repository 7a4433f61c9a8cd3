#!/usr/bin/env bash
# Shared set-up for demo.sh and test.sh: .venv at the repo root with the project
# installed, and the local Kafka broker running. Safe to run again: each step is
# skipped when it is already done.
set -euo pipefail
case "${1:-}" in  # no arguments; --help must not start the work
  "") ;;
  -h|--help) echo "usage: $0"; sed -n '2,/^set -/s/^# \{0,1\}//p' "$0"; exit 0 ;;
  *) echo "usage: $0 (no arguments)" >&2; exit 2 ;;
esac

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
EXTRAS="${PIPELINE_EXTRAS:-dev}"
cd "$REPO"

if [[ ! -x .venv/bin/python ]]; then
  "$PYTHON" - <<'PY' || { echo "setup: Python 3.10+ is needed (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
import sys
sys.exit(0 if sys.version_info >= (3, 10) else 1)
PY
  echo "setup: creating .venv with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv
fi

# Reinstall only when pyproject.toml changed since the last install.
stamp=".venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)-$EXTRAS"
if [[ ! -f "$stamp" ]]; then
  echo "setup: installing the project and its dependencies into .venv (torch is large: first time takes minutes)"
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[$EXTRAS]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi

scripts/dev-kafka.sh start
