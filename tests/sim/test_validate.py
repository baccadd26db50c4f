"""`pdserve.sim.validate`: the simulator against `bench compare` results. The table's arithmetic is
checked on numbers made up here; end to end, results that are themselves the simulator's output
for a configuration's layout, workload and load points validate with zero error, and a layout the
validation would misread (another decode count) does not."""

from __future__ import annotations

import json
import math

import pytest

from pdserve.workload.host_cpu import NOISY_OTHERS_CORES
from pdserve.workload.loadgen import LengthDist, WorkloadSpec
from pdserve.router.policy import DisaggregationPolicy
from pdserve.sim.cluster import SimCluster
from pdserve.sim.profile import perf_model
from pdserve.sim.simulate import simulate_sweep
from pdserve.sim.validate import compare, layout, main

QUIET = {"others": 0.0, "steal": 0.0}
NOISY = {"others": NOISY_OTHERS_CORES + 1.0, "steal": 0.0}


def test_layout_reads_the_serve_flags_and_their_defaults(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert layout([]) == {"prefill": 0, "decode": 0, "colocated": 1}  # what serve chooses on 2 cores
    assert layout(["--decode", "2"]) == {"prefill": 1, "decode": 2, "colocated": 0}
    assert layout(["--dtype", "float32", "--decode", "3", "--colocated", "2", "--prefill", "0"]) == \
        {"prefill": 0, "decode": 3, "colocated": 2}


def run(ttft: float, tpot: float | None, goodput: float, host_cpu: dict | None = None,
        rate: float | None = 2.0) -> dict:
    return {"load": {"request_rate": rate, "concurrency": None}, "ttft": {"mean": ttft}, "tpot": {"mean": tpot},
            "goodput": goodput, "host_cpu": host_cpu}


def test_compare_averages_the_quiet_runs_and_states_each_error():
    measured = [{"results": {"c": {"runs": [run(100, 10, 4.0, QUIET), run(50, None, 1.0, QUIET)]}}},
                {"results": {"c": {"runs": [run(300, 30, 2.0, NOISY), run(150, None, 3.0, NOISY)]}}},
                {"results": {"c": {"runs": [run(200, 20, 2.0, QUIET), run(70, None, 5.0, NOISY)]}}}]
    simulated = {"c": [run(165, 15, 3.0), run(100, 5, 3.0, rate=None)]}
    lines, rows = compare(measured, simulated)

    first, second = rows
    assert (first["runs"], first["noisy_runs"], second["noisy_runs"]) == (3, 1, 2)
    # the noisy run of the first point is left out: mean of 100 and 200 is 150, simulated 165: +10%
    assert first["TTFT mean ms"] == {"measured": [100, 200], "measured_mean": 150, "simulated": 165,
                                     "error": pytest.approx(0.1)}
    assert first["TPOT mean ms"]["error"] == pytest.approx(0.0)
    assert first["goodput req/s"]["error"] == pytest.approx(0.0)
    # the second point has one quiet run: only it counts; a metric nobody measured has no error
    assert second["TTFT mean ms"]["measured"] == [50] and second["TTFT mean ms"]["error"] == pytest.approx(1.0)
    assert second["TPOT mean ms"] == {"measured": [], "measured_mean": None, "simulated": 5, "error": None}
    assert lines[2] == "| c | 2.0 | 100 / 200 | 165 | +10% | 10 / 20 | 15 | +0% | 4 / 2 | 3 | +0% |"
    assert lines[3] == "| c | inf | 50 | 100 | +100% |  | - | - | 1 | 3 | +200% |"  # nothing to set it against
    # only noisy runs of a point: they count, and say so
    _, rows = compare([{"results": {"c": {"runs": [run(100, 10, 4.0, NOISY)]}}}], {"c": [run(100, 10, 4.0)]})
    assert rows[0]["noisy_runs"] == 1 and rows[0]["TTFT mean ms"]["measured"] == [100]


def profile_json(tmp_path):
    """A step and link model as `pdserve profile` writes one."""
    profile = {"model": "synthetic", "kv_bytes_per_token": 1000,
               "step": {"base_s": 0.004, "prefill_token_s": 2e-4, "prefill_attention_s": 1e-8, "decode_seq_s": 1e-3,
                        "decode_context_s": 2e-6},
               "links": {"shm": {"latency_s": 0.001, "bytes_per_s": 1e9}}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    return path, profile


def measured_as_simulated(profile_path, prefill: int, decode: int) -> dict:
    """`bench compare`'s JSON for one configuration, its numbers the simulator's for `prefill` +
    `decode` workers."""
    spec = WorkloadSpec(20, LengthDist.parse("200-400"), LengthDist.parse("8-16"), seed=3, vocab_size=500)
    model = perf_model(json.loads(profile_path.read_text()), "shm")
    points = [{"request_rate": 4.0, "concurrency": None}, {"request_rate": math.inf, "concurrency": 4}]
    runs = simulate_sweep(lambda: SimCluster(model, model, prefill, decode, 0, policy=DisaggregationPolicy(),
                                             transfer=model), spec, points, 1.0, 0.1, 0.05)
    return {"settings": {"configs": {"disaggregated": ["--prefill", "1", "--decode", "2"]},
                         "slo_ms": {"ttft": 100, "tpot": 50}},  # tight: not every request meets it
            "results": {"disaggregated": {"workload": spec.describe() | {"input_len": "200-400",
                                                                         "output_len": "8-16"},
                                          "runs": runs}}}


@pytest.mark.parametrize("decode", [2, 1])
def test_results_the_simulator_made_validate_with_no_error(tmp_path, capsys, decode):
    profile, _ = profile_json(tmp_path)
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps(measured_as_simulated(profile, prefill=1, decode=decode)))
    out = tmp_path / "validation.json"
    assert main(["--measured", str(measured), "--profile", f"disaggregated={profile}", "--vocab-size", "500",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["load"]["request_rate"] for row in rows] == [4.0, None]
    errors = [row[metric]["error"] for row in rows for metric in ("TTFT mean ms", "TPOT mean ms", "goodput req/s")]
    if decode == 2:  # the configuration's own layout: the same cluster, simulated again
        assert errors == [0.0] * 6
        assert capsys.readouterr().out.count("+0%") == 6
    else:  # measured on one decode worker, validated as the configuration's two: some error shows
        assert any(e != 0.0 for e in errors)


def test_a_profile_for_a_configuration_never_measured_is_refused(tmp_path):
    profile, _ = profile_json(tmp_path)
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps(measured_as_simulated(profile, 1, 2)))
    with pytest.raises(SystemExit):
        main(["--measured", str(measured), "--profile", f"colocated={profile}"])
