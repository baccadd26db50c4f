#!/usr/bin/env bash
# The design articles' two serving claims, projected by the simulator (no GPU needed):
# 1. Llama-3-70B, 4-bit weights, on A100-80G: one colocated TP4 instance against 2P+2D and
#    2P+4D (TP1 each), at 32, 64 and 128 concurrent requests.
# 2. DeepSeek-style MoE (8-bit weights) on H200, ISL 16k / OSL 2k: the best prefill:decode split
#    on a GPU budget against a fixed 1:1.
# 3. A day's traffic trace: P:D per hour. Results: results/claims/*.json, plots, and the tables printed here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=results/claims
mkdir -p "$OUT"
W70=(--gpu A100-80G --model-spec llama-3-70b --weight-bits 4 --link IB-HDR --input-len 2048 --output-len 200
     --request-rate inf --num-requests 400 --max-num-batched-tokens 2048 --max-num-seqs 256
     --ttft-slo 1000 --tpot-slo 50)
echo "== Llama-3-70B 4-bit on A100-80G, ISL 2048 / OSL 200 =="
"$PY" -m pdserve.cli simulate "${W70[@]}" --prefill 0 --decode 0 --colocated 1 --tp-decode 4 \
    --concurrency 32,64,128 --result-json "$OUT/llama70b_colocated_tp4.json"
"$PY" -m pdserve.cli simulate "${W70[@]}" --prefill 2 --decode 2 --concurrency 32,64,128 \
    --result-json "$OUT/llama70b_2p2d.json"
"$PY" -m pdserve.cli simulate "${W70[@]}" --prefill 2 --decode 4 --concurrency 32,64,128 \
    --result-json "$OUT/llama70b_2p4d.json"
echo "== DeepSeek-style MoE 8-bit on H200 (TP8 instances), ISL 16k / OSL 2k, 32 GPUs =="
"$PY" -m pdserve.cli plan --hardware H200 --model deepseek-v3 --weight-bits 8 --link IB-NDR --tp 8 --batch 64,256 \
    --isl 16384 --osl 2048 --qps 1 --ttft-slo 5000 --tpot-slo 100 --max-gpus 32 --budget 32 --num-requests 200 \
    --json "$OUT/deepseek_rate_matching.json" --plot-dir "$OUT"
echo "== the same with TPOT <= 40 ms =="
"$PY" -m pdserve.cli plan --hardware H200 --model deepseek-v3 --weight-bits 8 --link IB-NDR --tp 8 --batch 64,256 \
    --isl 16384 --osl 2048 --qps 1 --ttft-slo 5000 --tpot-slo 40 --max-gpus 32 --budget 32 --num-requests 200 \
    --json "$OUT/deepseek_rate_matching_tpot40.json"
echo "== dynamic rate matching over a day's trace (Llama-3-8B, H100) =="
"$PY" -m pdserve.cli plan --trace examples/trace_day.csv --hardware H100-SXM --model llama-3-8b --tp 1,2 \
    --batch 64,256 --ttft-slo 2000 --tpot-slo 50 --json "$OUT/trace_day.json" --plot-dir "$OUT"
