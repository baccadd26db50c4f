#!/usr/bin/env bash
# lm-evaluation-harness as a peer's test: a 20-question multiple-choice task kept in the repository
# (tests/lm_eval/tinymc.jsonl), scored by lm-eval's `local-completions` model against `pdserve serve`
# (the default model in float32, weights dequantized) and by its `hf` model on the same checkpoint.
# Passes when both give the same accuracy; prints the largest per-choice log-likelihood gap.
# lm-eval lives in a venv of its own (.venv-lmeval), never in pdserve's. Run after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PORT=${PORT:-8777}
PY=${PYTHON:-python3.11}
if [ ! -x .venv-lmeval/bin/lm_eval ]; then
  "$PY" -m venv .venv-lmeval
  .venv-lmeval/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  .venv-lmeval/bin/python -m pip install -q --disable-pip-version-check "lm-eval[hf,api]==0.4.13" "torch==2.13.0"
fi
# the default model as a Hugging Face directory (converted from its GGUF once, then cached)
HF_DIR=$(.venv/bin/python -c "
from pdserve.models.default_model import cache_entry, default_model_path
from pdserve.models.loader import load_checkpoint
load_checkpoint(default_model_path())
print(cache_entry(default_model_path()))")
WORK=$(mktemp -d)
trap 'if [ -n "${SERVER:-}" ]; then kill -TERM "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true; fi; rm -rf "$WORK"' EXIT
sed "s#DATA#$ROOT/tests/lm_eval/tinymc.jsonl#" > "$WORK/tinymc.yaml" <<'YAML'
task: tinymc
dataset_path: json
dataset_kwargs:
  data_files:
    test: DATA
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
YAML
.venv/bin/pdserve serve --port "$PORT" --dtype float32 --quantization none --colocated 1 > "$WORK/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 300); do grep -q '"event": "ready"' "$WORK/serve.log" && break; sleep 1; done
grep -q '"event": "ready"' "$WORK/serve.log" || { cat "$WORK/serve.log" >&2; exit 1; }
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
LM=".venv-lmeval/bin/lm_eval --tasks tinymc --include_path $WORK --batch_size 4 --log_samples"
$LM --model local-completions --output_path "$WORK/pdserve" --model_args \
  "model=default,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$HF_DIR,tokenized_requests=True,num_concurrent=1,max_retries=1"
$LM --model hf --device cpu --output_path "$WORK/hf" --model_args "pretrained=$HF_DIR,dtype=float32"
.venv-lmeval/bin/python - "$WORK" <<'PYTHON'
import glob, json, sys
def load(name):
    (path,) = glob.glob(f"{sys.argv[1]}/{name}/*/samples_tinymc_*.jsonl")
    rows = [json.loads(line) for line in open(path)]
    return {r["doc_id"]: ([float(x[0]) for x in r["filtered_resps"]], r["acc"]) for r in rows}
ours, theirs = load("pdserve"), load("hf")
gap = max(abs(a - b) for k in theirs for a, b in zip(ours[k][0], theirs[k][0]))
acc = {name: sum(v[1] for v in d.values()) / len(d) for name, d in (("pdserve", ours), ("hf", theirs))}
print(f"lm-eval tinymc ({len(theirs)} questions): accuracy pdserve {acc['pdserve']:.2f}, hf {acc['hf']:.2f}; "
      f"largest per-choice log-likelihood gap {gap:.1e}")
sys.exit(0 if acc["pdserve"] == acc["hf"] else 1)
PYTHON
