"""The planner on a synthetic performance model whose optimum is known, and `pdserve plan`'s
answers: the plan's JSON, impossible SLAs, and a trace."""

from __future__ import annotations

import json

import pytest

from pdserve.workload.loadgen import LengthDist
from pdserve.sim.perf import LinearPerfModel
from pdserve.sim.plan import InstanceSpec, Planner, Traffic, unreachable
from pdserve.sim.verdict import SLA
from pdserve.sim.plan_cli import main

# A step takes 10 ms + 1 ms per prompt token on one GPU, whatever its batch; two GPUs are 1.2x as
# fast, not 2x. So for ISL 100 / OSL 10 at 15 req/s within TTFT 1 s and TPOT 12 ms:
# - one prefill instance serves at most 9.8 req/s (five prompts per 512-token step), so TP1 needs
#   two; TP2 (11.8 req/s at most) needs two as well, at four GPUs;
# - a decode batch of 1 serves 11.1 req/s (the first token comes with the KV, then nine steps of
#   10 ms); a batch of 64 serves them all;
# - colocated, any prefill stalls the decodes beside it for 100 ms: TPOT 12 ms is missed as soon as
#   requests overlap, so colocated needs far more than the budget.
# The optimum is 2 prefill + 1 decode (batch 64), all TP1: 3 GPUs.
SYNTHETIC = LinearPerfModel(base_s=0.010, prefill_token_s=0.001)


def synthetic(tp: int) -> InstanceSpec:
    m = SYNTHETIC
    speedup = 1.0 if tp == 1 else 0.6 * tp
    return InstanceSpec(LinearPerfModel(base_s=m.base_s / speedup, prefill_token_s=m.prefill_token_s / speedup),
                        kv_tokens=1 << 16)


def planner(qps=15.0, ttft=1.0, tpot=0.012, max_gpus=8) -> Planner:
    traffic = Traffic(LengthDist.parse("100"), LengthDist.parse("10"), qps)
    return Planner(synthetic, traffic, SLA(ttft, tpot), tps=(1, 2), batches=(1, 64), max_gpus=max_gpus,
                   chunk_tokens=512, num_requests=120)


def test_the_planner_finds_the_known_optimum():
    p = planner()
    caps = {(c.kind, c.tp, c.batch): c.rate for c in p.measure()}
    assert 7.5 < caps[("prefill", 1, 0)] <= 9.8  # its service rate, less what queueing takes
    # the search answers within its tolerance below the capacity (10.06 req/s at a tolerance of 0.5%)
    assert 9.8 < caps[("prefill", 2, 0)] * (1 + p.tolerance) and caps[("prefill", 2, 0)] <= 11.8
    assert caps[("decode", 1, 1)] <= 11.2 < caps[("decode", 1, 64)]
    assert caps[("colocated", 1, 64)] < 2  # the stalls
    config, outcome = p.best()
    assert (config.mode, config.num_prefill, config.tp_prefill, config.num_decode, config.tp_decode, config.batch) \
        == ("disaggregated", 2, 1, 1, 1, 64)
    assert config.num_gpus == 3 and not outcome.misses(p.sla)
    # fewer prefill instances than the plan misses the TTFT bound in the whole simulation
    import dataclasses
    assert "ttft" in p.verify(dataclasses.replace(config, num_prefill=1)).misses(p.sla)
    front = p.pareto()
    assert [c.num_gpus for c in front] == sorted({c.num_gpus for c in front})
    assert all(a.goodput < b.goodput for a, b in zip(front, front[1:]))


def test_an_unreachable_bound_is_named_with_the_best_reachable_value():
    p = planner(ttft=0.05)
    reasons = unreachable(p.measure(), p.sla)
    assert len(reasons) == 1 and "TTFT <= 50 ms is out of reach" in reasons[0]
    assert "is 91.7 ms (" in reasons[0] and "TP2)" in reasons[0]  # 110 ms / 1.2
    assert p.best() is None


def _profile(tmp_path) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"step": {k: v for k, v in SYNTHETIC.to_json().items() if k.endswith("_s") and
                                         not k.startswith("link")}, "kv_bytes_per_token": 0, "links": {}}))
    return str(path)


COMMON = ["--isl", "100", "--osl", "10", "--tp", "1", "--batch", "64", "--chunk-tokens", "512",
          "--num-requests", "80"]


def test_plan_writes_the_best_configuration_as_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["--profile", _profile(tmp_path), *COMMON, "--qps", "15", "--ttft-slo", "1000", "--tpot-slo", "12",
                 "--max-gpus", "6", "--budget", "4", "--json", str(out), "--plot-dir", str(tmp_path)]) == 0
    plan = json.loads(out.read_text())
    best = plan["best"]
    assert {k: best[k] for k in ("mode", "num_prefill", "tp_prefill", "num_decode", "tp_decode", "num_gpus")} == \
        {"mode": "disaggregated", "num_prefill": 2, "tp_prefill": 1, "num_decode": 1, "tp_decode": 1, "num_gpus": 3}
    assert best["goodput"] >= 15 and best["goodput_per_gpu"] == pytest.approx(best["goodput"] / 3)
    assert plan["pareto"] and all({"mode", "num_gpus", "goodput_per_gpu"} <= set(c) for c in plan["pareto"])
    assert plan["budget"]["gpus"] == 4 and plan["budget"]["ratio"] >= 1.0
    text = capsys.readouterr().out
    assert "Plan: disaggregated 2P x TP1 + 1D x TP1" in text and "Only disaggregated serving meets the SLA" in text
    assert (tmp_path / "plan_pareto.png").stat().st_size > 0


@pytest.mark.parametrize("flags,message", [
    (["--qps", "1", "--ttft-slo", "50"], "TTFT <= 50 ms is out of reach: the best any instance does, one request "
                                         "at a time, is 110.0 ms"),
    (["--qps", "1", "--tpot-slo", "5"], "TPOT <= 5 ms is out of reach"),
    (["--qps", "100", "--max-gpus", "4"], "100 req/s within the SLA needs more than 4 GPUs"),
])
def test_plan_rejects_impossible_slas(tmp_path, capsys, flags, message):
    out = tmp_path / "plan.json"
    args = ["--profile", _profile(tmp_path), *COMMON, "--ttft-slo", "1000", "--tpot-slo", "12", "--json", str(out)]
    assert main(args + flags) == 1
    assert message in capsys.readouterr().out
    assert json.loads(out.read_text())["best"] is None


def test_plan_refuses_bad_arguments(capsys):
    for bad in (["--qps", "0"], ["--tp", "0"], ["--isl", "x"], ["--hardware", "TPU"], ["--percentile", "120"],
                ["--hardware", "A100-80G", "--weight-bits", "8", "--fp8-compute"]):
        with pytest.raises(SystemExit) as e:
            main(bad)
        assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_a_trace_gets_a_prefill_decode_split_per_window(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,qps,isl,osl\n0,5,100,10\n3600,15,100,10\n7200,15,200,10\n")
    out = tmp_path / "trace.json"
    assert main(["--profile", _profile(tmp_path), *COMMON, "--ttft-slo", "1000", "--tpot-slo", "12",
                 "--trace", str(trace), "--json", str(out), "--plot-dir", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    splits = [(w["num_prefill"], w["num_decode"]) for w in result["windows"]]
    assert splits[0] == (1, 1) and splits[1] == (2, 1) and splits[2][0] >= 3  # longer prompts, more prefill
    hours = result["gpu_hours"]
    assert hours["dynamic"] < hours["static_matched"] <= hours["static_one_to_one"]
    assert (tmp_path / "plan_trace.png").stat().st_size > 0
