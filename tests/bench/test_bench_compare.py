"""`pdserve bench compare` on the tiny model: three real local clusters, one sweep each (slow), and
its table of ratios against a baseline row."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.compare import main


@pytest.mark.slow
def test_compare_runs_every_configuration(tmp_path, capsys):
    out, plots = tmp_path / "c.json", tmp_path / "plots"
    code = main(["--model", "tiny", "--serve-args", "--dtype float32", "--num-requests", "4", "--request-rate",
                 "inf", "--concurrency", "1,2", "--input-len", "300", "--output-len", "6", "--result-json", str(out),
                 "--plot-dir", str(plots)])
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result["results"]) == {"colocated", "disaggregated", "replicas"}
    assert result["settings"]["cores"] >= 1 and result["settings"]["model"] == "tiny"
    layouts = {name: [p["name"].split(" ")[0] for p in r["processes"] if p["name"] != "router"]
               for name, r in result["results"].items()}
    assert layouts == {"colocated": ["both"], "disaggregated": ["prefill", "decode"], "replicas": ["both", "both"]}
    for name, res in result["results"].items():
        assert [r["load"]["concurrency"] for r in res["runs"]] == [1, 2]
        assert all(r["completed"] == 4 and r["failed"] == 0 for r in res["runs"])
        assert res["memory_mib_peak"] > 0
    disagg = result["results"]["disaggregated"]["runs"][0]
    assert disagg["phases_ms"]["transfer"] >= 0 and disagg["phases_ms"]["prefill"] > 0
    table = capsys.readouterr().out
    assert table.count("| colocated |") == 2 and "vs colocated" in table
    assert (plots / "compare_goodput_vs_load.png").exists()
    assert len(list(plots.glob("compare_cdf_*.png"))) == 2


@pytest.mark.slow
def test_a_running_server_is_compared_as_a_peer(tmp_path, capsys):
    from pdserve.bench.local_cluster import LocalCluster

    peer = LocalCluster("tiny", ["--dtype", "float32", "--prefill", "0", "--decode", "0", "--colocated", "1"])
    try:
        out = tmp_path / "c.json"
        code = main(["--model", "tiny", "--configs", "colocated", "--serve-args", "--dtype float32",
                     "--peer-url", f"other={peer.url}", "--num-requests", "4", "--request-rate", "inf",
                     "--concurrency", "2", "--input-len", "200", "--output-len", "6", "--result-json", str(out),
                     "--plot-dir", str(tmp_path / "plots")])
    finally:
        peer.stop()
    assert code == 0
    result = json.loads(out.read_text())
    assert list(result["results"]) == ["colocated", "other"] and result["settings"]["peers"] == {"other": peer.url}
    other = result["results"]["other"]
    assert [p["pid"] for p in other["processes"]][0] == peer.pids["router"]
    assert other["memory_mib_peak"] > 0 and all(r["completed"] == 4 for r in other["runs"])
    assert "| other | 2" in capsys.readouterr().out  # its row (marked "(noisy)" when a neighbour was busy)


def test_the_table_gives_each_row_against_the_baseline():
    from pdserve.bench.compare import table

    def run(tok_s, ttft, tpot):
        return {"load": {"concurrency": 1, "request_rate": None}, "completed": 4, "num_requests": 4,
                "output_throughput": tok_s, "ttft": {"mean": ttft, "p99": ttft}, "tpot": {"mean": tpot, "p99": tpot},
                "goodput": 1.0, "sla_attainment_pct": 100.0, "host_cpu": None}

    results = {"default": {"runs": [run(30.0, 200.0, 30.0)], "memory_mib_peak": 900.0},
               "vllm": {"runs": [run(20.0, 400.0, 50.0)], "memory_mib_peak": None}}
    shown = table(results, "vllm")
    assert "vs vllm: tok/s, TTFT, TPOT" in shown
    assert "| default | 1 | 4/4 | 30.0 | 200 / 200 | 30 / 30 | 1.000 | 100 | 1.50x, 0.50x, 0.60x | 900 |" in shown
    assert "| vllm | 1 | 4/4 | 20.0 | 400 / 400 | 50 / 50 | 1.000 | 100 | 1.00x, 1.00x, 1.00x | - |" in shown
