#!/usr/bin/env bash
# Sets everything up, then runs the main job with the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pdserve generate "$@"
