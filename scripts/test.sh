#!/usr/bin/env bash
# Sets everything up, then runs the default test suite (slow end-to-end runs: add `-m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -rs "$@"  # -rs: what was skipped and why (a backend or extra this host lacks)
