#!/usr/bin/env bash
# Sets everything up, then runs the main job: the local disaggregated cluster (router, one prefill
# and one decode worker) with the default model, until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pdserve serve "$@"
