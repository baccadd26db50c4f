"""`pdserve bench` end to end against a real local cluster (router + 1 prefill + 1 decode worker,
tiny model): every field of the JSON, counts that agree, the server's phases, and the plots."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.serving import main

FIELDS = ("num_requests", "completed", "failed", "ttft", "tpot", "itl", "e2e", "request_throughput",
          "output_throughput", "goodput", "sla_attainment_pct")


def check_run(run: dict, num_requests: int, met_pct: float, output_len: int | None = None) -> None:
    """`met_pct`: the share of requests meeting the SLA the run was given (one every request meets,
    or one none can), so goodput and attainment have exact values. The percentiles' arithmetic is
    checked on synthetic timestamps (test_serving_metrics); here, that every metric got values."""
    assert set(FIELDS) <= set(run)
    assert run["num_requests"] == num_requests and run["completed"] + run["failed"] == num_requests
    assert run["completed"] == num_requests, run["errors"]
    for metric in ("ttft", "tpot", "itl", "e2e"):
        d = run[metric]
        assert set(d) == {"mean", "p50", "p90", "p99"}
        assert all(isinstance(v, float) for v in d.values()), (metric, d)  # None: no request gave one
    assert run["ttft"]["p50"] <= run["e2e"]["p50"]
    if output_len is not None:  # EOS ignored: exactly the asked tokens
        expected = run["completed"] * output_len / run["duration_s"]
        assert run["output_throughput"] == pytest.approx(expected)
    assert run["sla_attainment_pct"] == met_pct
    assert run["goodput"] == pytest.approx(run["request_throughput"] * met_pct / 100)
    assert set(run["phases_ms"]) == {"queue", "prefill", "transfer", "decode"}


def test_bench_single_point_writes_json_and_plots(router_cluster, tmp_path, capsys):
    out, plots = tmp_path / "r.json", tmp_path / "plots"
    code = main(["--url", router_cluster["url"], "--num-requests", "6", "--request-rate", "inf", "--concurrency", "3",
                 "--input-len", "300", "--output-len", "6", "--seed", "3", "--result-json", str(out),
                 "--plot-dir", str(plots), "--ttft-slo", "1e9", "--tpot-slo", "1e9"])  # met by every request
    assert code == 0
    result = json.loads(out.read_text())
    check_run(result, 6, met_pct=100.0, output_len=6)
    assert result["settings"]["model"] == "tiny" and result["settings"]["input_len"] == "300"
    assert len(result["runs"]) == 1
    assert (plots / "latency_cdf.png").stat().st_size > 10_000
    assert "| load |" in capsys.readouterr().out
    assert router_cluster["router"].admission.requests == 0


def test_bench_sweep_with_sessions_and_shared_prefixes(router_cluster, tmp_path):
    out, plots = tmp_path / "r.json", tmp_path / "plots"
    code = main(["--url", router_cluster["url"], "--num-requests", "6", "--request-rate", "20,40",
                 "--input-len", "8-24", "--output-len", "4+-1", "--shared-prefix-len", "16", "--num-prefixes", "2",
                 "--turns", "2", "--result-json", str(out), "--plot-dir", str(plots),
                 "--ttft-slo", "1e-6"])  # a nanosecond: met by none
    assert code == 0
    result = json.loads(out.read_text())
    assert [r["load"]["request_rate"] for r in result["runs"]] == [20, 40]
    for run in result["runs"]:
        check_run(run, 6, met_pct=0.0)
    assert (plots / "goodput_vs_load.png").stat().st_size > 10_000


def test_bench_refuses_bad_flags(router_cluster, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--url", router_cluster["url"], "--input-len", "lots"])
    assert e.value.code == 2 and "a length is N" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--url", router_cluster["url"], "--request-rate", "1,2", "--concurrency", "1,2"])


def test_bench_sends_structured_requests(router_cluster, tmp_path, capsys):
    """`--extra-body` goes into every request: here a structure each answer must match (so it ends
    when the structure does, before the length limit)."""
    out = tmp_path / "r.json"
    extra = {"structured_outputs": {"choice": ["yes", "no"]}}
    code = main(["--url", router_cluster["url"], "--num-requests", "4", "--request-rate", "inf", "--input-len", "40",
                 "--output-len", "30", "--extra-body", json.dumps(extra), "--result-json", str(out),
                 "--plot-dir", str(tmp_path / "plots")])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["settings"]["extra_body"] == extra and result["completed"] == 4
    tokens = result["output_throughput"] * result["duration_s"]
    assert 0 < tokens < 4 * 30 / 2  # each answer is "yes" or "no", not 30 tokens
    with pytest.raises(SystemExit) as e:
        main(["--url", router_cluster["url"], "--extra-body", "[1, 2]"])
    assert e.value.code == 2 and "a JSON object" in capsys.readouterr().err
