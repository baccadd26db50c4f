#!/usr/bin/env bash
# The simulator against this machine (about 75 minutes; run it on an otherwise idle machine):
# 0. offline step profiles, 1 and 2 threads (kept if present);
# 1. in-serving step profiles: each layout of `pdserve bench compare` serves calibration workloads
#    of its own while its workers log every step;
# 2. those logs fitted into step models, per worker role;
# 3. the validation workload measured: `pdserve bench compare` with its defaults, twice;
# 4. the same workload simulated with either set of step models, side by side with the measurement.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-results/validation}
mkdir -p "$OUT"
for t in 1 2; do
  [ -f "$OUT/profile_${t}thread.json" ] || "$PY" -m pdserve.cli profile --threads $t --out "$OUT/profile_${t}thread.json"
done
# Two calibration workloads, both unlike the validation one in prompts, lengths and seed: closed
# loop at 1-4 concurrent ("serving"), and Poisson arrivals over the validation's range of rates
# ("loaded"), since on shared cores a step's time depends on how busy the rest of the machine is.
calibrate() {  # NAME, then the workload flags
  local name=$1; shift
  for c in colocated disaggregated replicas; do
    [ -s "$OUT/$name/$c/both-0.jsonl" ] || [ -s "$OUT/$name/$c/decode-1.jsonl" ] && continue
    rm -rf "$OUT/$name/$c"
    "$PY" -m pdserve.cli bench compare --configs $c --serve-args "--record-steps $OUT/$name/$c" "$@" \
        --result-json "$OUT/calibration_${name}_$c.json" --plot-dir "$OUT/plots_calibration"
  done
  fit() { local out=$1; shift; "$PY" -m pdserve.cli profile --from-steps "$@" --links-from "$OUT/profile_1thread.json" --out "$out"; }
  fit "$OUT/${name}_colocated.json" "$OUT/$name/colocated/both-0.jsonl"
  fit "$OUT/${name}_prefill.json" "$OUT/$name/disaggregated/prefill-0.jsonl"
  fit "$OUT/${name}_decode.json" "$OUT/$name/disaggregated/decode-1.jsonl"
  fit "$OUT/${name}_replicas.json" "$OUT/$name/replicas/both-0.jsonl" "$OUT/$name/replicas/both-1.jsonl"
}
calibrate serving --input-len 64-2048 --output-len 32 --request-rate inf --concurrency 1,2,4 --num-requests 12 --seed 100
calibrate loaded --input-len 512-1536 --output-len 48 --request-rate 0.1,0.2,0.3,0.4 --num-requests 12 --seed 200
# The validation workload, measured RUNS times (each point's `host_cpu` says whether the machine was
# quiet; the validation takes the quiet runs' mean, and shows each run)
RUNS=${RUNS:-2}
measured=()
for i in $(seq 1 "$RUNS"); do
  m="$OUT/measured-$i.json"
  [ -f "$m" ] || "$PY" -m pdserve.cli bench compare --result-json "$m" --plot-dir "$OUT/plots-$i"
  measured+=("$m")
done
echo "== offline profiles =="
"$PY" -m pdserve.sim.validate --measured "${measured[@]}" --out "$OUT/validation_offline.json" \
    --profile colocated="$OUT/profile_2thread.json" --profile disaggregated="$OUT/profile_1thread.json" \
    --profile replicas="$OUT/profile_1thread.json"
for name in serving loaded; do
  echo "== in-serving profiles: $name =="
  "$PY" -m pdserve.sim.validate --measured "${measured[@]}" --out "$OUT/validation_$name.json" \
      --profile colocated="$OUT/${name}_colocated.json" \
      --profile disaggregated="$OUT/${name}_prefill.json,$OUT/${name}_decode.json" \
      --profile replicas="$OUT/${name}_replicas.json"
done
