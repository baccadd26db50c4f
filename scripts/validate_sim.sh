#!/usr/bin/env bash
# The simulator against this machine (about 45 minutes; run it on an otherwise idle machine):
# 0. offline step profiles, 1 and 2 threads (kept if present);
# 1. in-serving step profiles: each layout of `pdserve bench compare` serves a calibration workload
#    of its own (prompts of 64-2048 tokens, 1-4 concurrent) while its workers log every step;
# 2. those logs fitted into step models, per worker role;
# 3. the validation workload measured: `pdserve bench compare` with its defaults;
# 4. the same workload simulated with either set of step models, side by side with the measurement.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-results/validation}
mkdir -p "$OUT"
for t in 1 2; do
  [ -f "$OUT/profile_${t}thread.json" ] || "$PY" -m pdserve.cli profile --threads $t --out "$OUT/profile_${t}thread.json"
done
for c in colocated disaggregated replicas; do
  rm -rf "$OUT/steps/$c"
  "$PY" -m pdserve.cli bench compare --configs $c --serve-args "--record-steps $OUT/steps/$c" \
      --input-len 64-2048 --output-len 32 --request-rate inf --concurrency 1,2,4 --num-requests 12 --seed 100 \
      --result-json "$OUT/calibration_$c.json" --plot-dir "$OUT/plots_calibration"
done
fit() { local out=$1; shift; "$PY" -m pdserve.cli profile --from-steps "$@" --links-from "$OUT/profile_1thread.json" --out "$out"; }
fit "$OUT/serving_colocated.json" "$OUT/steps/colocated/both-0.jsonl"
fit "$OUT/serving_prefill.json" "$OUT/steps/disaggregated/prefill-0.jsonl"
fit "$OUT/serving_decode.json" "$OUT/steps/disaggregated/decode-1.jsonl"
fit "$OUT/serving_replicas.json" "$OUT/steps/replicas/both-0.jsonl" "$OUT/steps/replicas/both-1.jsonl"
[ -f "$OUT/measured.json" ] || "$PY" -m pdserve.cli bench compare --result-json "$OUT/measured.json" --plot-dir "$OUT/plots"
echo "== offline profiles =="
"$PY" -m pdserve.sim.validate --measured "$OUT/measured.json" --out "$OUT/validation_offline.json" \
    --profile colocated="$OUT/profile_2thread.json" --profile disaggregated="$OUT/profile_1thread.json" \
    --profile replicas="$OUT/profile_1thread.json"
echo "== in-serving profiles =="
"$PY" -m pdserve.sim.validate --measured "$OUT/measured.json" --out "$OUT/validation_serving.json" \
    --profile colocated="$OUT/serving_colocated.json" \
    --profile disaggregated="$OUT/serving_prefill.json,$OUT/serving_decode.json" \
    --profile replicas="$OUT/serving_replicas.json"
