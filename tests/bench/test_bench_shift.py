"""`pdserve bench shift`: its pure parts (the two-phase workload, splits, the best static split of
each half, the controller's moves read from a log, the table), its refusals of bad flags, and one
small end-to-end run on the tiny model (slow)."""

from __future__ import annotations

import json
import time

import pytest

from pdserve.workload.loadgen import LengthDist
from pdserve.workload.metrics import RequestRecord
from pdserve.bench.shift import main
from pdserve.bench.shift_report import best_static, half_summaries, parse_decisions, parse_moves, ratios, table
from pdserve.bench.shift_workload import Phase, Split, build_shift_workload, disaggregated_splits

PHASES = [Phase("long prompts, short answers", 10.0, 2.0, LengthDist.parse("100+-10"), LengthDist.parse("4")),
          Phase("short prompts, long answers", 10.0, 3.0, LengthDist.parse("8"), LengthDist.parse("50"))]


def test_splits_are_read_as_serve_is_asked_for_them():
    assert Split.parse("2P1D") == Split(2, 1) and Split.parse("3c") == Split(0, 0, 3)
    assert Split(2, 1).serve_args == ["--prefill", "2", "--decode", "1", "--colocated", "0"]
    assert [str(s) for s in disaggregated_splits(4)] == ["3P1D", "2P2D", "1P3D"]
    for bad in ("0P2D", "2P0D", "0C", "P1D", "2D1P", ""):
        with pytest.raises(ValueError):
            Split.parse(bad)


def test_the_workload_turns_halfway_and_is_the_same_for_every_seed_use():
    w = build_shift_workload(PHASES, seed=3, vocab_size=500)
    assert w.phase_of == [0] * 20 + [1] * 30 and w.boundaries == [0.0, 10.0]
    assert w.offsets == sorted(w.offsets)
    first, second = [w.requests[i] for i in range(20)], [w.requests[i] for i in range(20, 50)]
    assert all(80 <= r.prompt_tokens <= 120 and r.max_tokens == 4 for r in first)
    assert all(r.prompt_tokens == 8 and r.max_tokens == 50 for r in second)
    assert all(0 <= t < 10 for t in w.offsets[:20]) and all(10 <= t < 20 for t in w.offsets[20:])
    again = build_shift_workload(PHASES, seed=3, vocab_size=500)
    assert again.offsets == w.offsets and [r.prompt for r in again.requests] == [r.prompt for r in w.requests]
    assert build_shift_workload(PHASES, seed=4, vocab_size=500).offsets != w.offsets
    with pytest.raises(ValueError):
        Phase("none", 0.0, 1.0, LengthDist.parse("8"), LengthDist.parse("8"))


def record(start: float, ttft: float, tokens: int, tpot: float) -> RequestRecord:
    first = start + ttft
    chunks = [first + i * tpot for i in range(tokens)]
    return RequestRecord(start, 8, first, chunks[-1], tokens, chunks)


def result(goodputs: list[float], rebalance: bool = False) -> dict:
    halves = [{"goodput": g, "output_throughput": 10 * g, "completed": 4, "num_requests": 4,
               "sla_attainment_pct": 100.0, "ttft": {"p50": 100.0, "p90": 200.0},
               "tpot": {"p50": 10.0, "p90": 20.0}} for g in goodputs]
    return {"split": "1P2D", "rebalance": rebalance, "halves": halves}


def test_each_half_is_measured_on_the_requests_sent_in_it():
    records = [record(0.0, 0.1, 5, 0.01), record(1.0, 9.0, 5, 0.01), record(10.0, 0.1, 50, 0.5)]
    halves = half_summaries(records, [0, 0, 1], 2, ttft_slo_s=1.0, tpot_slo_s=0.1)
    assert [h["num_requests"] for h in halves] == [2, 1]
    assert halves[0]["sla_attainment_pct"] == 50.0  # the second waited 9 s for its first token
    assert halves[1]["sla_attainment_pct"] == 0.0  # 500 ms a token


def test_the_best_static_split_of_each_half_and_the_controller_against_it():
    results = {"rebalance": result([0.9, 0.8], rebalance=True), "1P1D": result([0.3, 0.4]),
               "2P1D": result([0.6, 0.2]), "1P2D": result([0.2, 1.0])}
    assert best_static(results, 0) == "2P1D" and best_static(results, 1) == "1P2D"
    rows = ratios(results, 2)
    assert rows[0] == {"half": 0, "best_static": "2P1D", "vs_1p1d": pytest.approx(3.0),
                       "vs_best_static": pytest.approx(1.5)}
    assert rows[1]["vs_1p1d"] == pytest.approx(2.0) and rows[1]["vs_best_static"] == pytest.approx(0.8)
    results["rebalance"]["moves"] = [{"at_s": 12.0, "worker": "w3", "from": "decode", "to": "prefill",
                                      "reason": "prefill at 2.00x", "serving_at_s": 14.5}]
    shown = table(results, 2)
    assert "| 2P1D | 1 | 4/4 | 0.600 |" in shown and "| best |" in shown and "| 1.50x |" in shown
    assert "at 12s w3 decode -> prefill, serving as prefill at 14s: prefill at 2.00x" in shown


def test_the_moves_come_from_the_router_and_worker_log_lines():
    start = time.mktime(time.strptime("2026-01-02 03:04:00", "%Y-%m-%d %H:%M:%S"))
    log = "\n".join([
        "2026-01-02 03:04:01,000 pdserve.router INFO worker w1 registered: prefill at http://127.0.0.1:1",
        "2026-01-02 03:04:10,000 pdserve.router INFO rebalance: to_prefill asked for 0s of 5: prefill at 2.10x",
        "2026-01-02 03:04:20,250 pdserve.router INFO rebalance: w3 decode -> prefill: prefill at 2.10x its target",
        "2026-01-02 03:04:23,500 pdserve.worker INFO role decode -> prefill (drained)",
        "2026-01-02 03:05:10,000 pdserve.router INFO rebalance: w2 prefill -> decode: decode at 1.30x",
    ])
    moves = parse_moves(log, start)
    assert moves[0] == {"at_s": 20.25, "worker": "w3", "from": "decode", "to": "prefill",
                        "reason": "prefill at 2.10x its target", "serving_at_s": 23.5, "drain": "drained"}
    assert moves[1]["at_s"] == 70.0 and moves[1]["serving_at_s"] is None  # never seen serving in its new role
    assert parse_decisions(log, start) == [{"at_s": 10.0, "said": "to_prefill asked for 0s of 5: prefill at 2.10x"}]


def test_a_measured_rate_is_the_stronger_splits_capacity_unless_the_splits_serve_alike():
    from pdserve.bench.shift_probe import FALLBACK_LOAD, probe_splits, rate_from

    assert [str(s) for s in probe_splits(3)] == ["2P1D", "1P2D"]
    assert [str(s) for s in probe_splits(5)] == ["4P1D", "1P4D"]
    rate, distinct = rate_from([0.2, 0.8])
    assert distinct and rate == pytest.approx(0.8)  # past what the weaker split serves
    assert rate_from([0.5, 0.55]) == (pytest.approx(FALLBACK_LOAD * 0.55), False)  # a load both serve
    assert rate_from([0.0, 0.3]) == (pytest.approx(FALLBACK_LOAD * 0.3), False)


@pytest.mark.parametrize("argv", [["--workers", "2"], ["--start", "2P2D"], ["--start", "3C"], ["--splits", "2P1X"],
                                  ["--phase-s", "0"], ["--phase1-rate", "-1"], ["--phase2-input-len", "many"],
                                  ["--rebalance-dwell-s", "nan"], ["--tpot-slo", "0"]])
def test_bad_flags_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "error" in capsys.readouterr().err


@pytest.mark.slow
def test_a_small_run_writes_every_configuration(tmp_path, capsys):
    out = tmp_path / "shift.json"
    code = main(["--model", "tiny", "--serve-args", "--dtype float32", "--splits", "2P1D", "--phase-s", "3",
                 "--phase1-rate", "2", "--phase1-input-len", "300", "--phase1-output-len", "4", "--phase2-rate", "2",
                 "--phase2-input-len", "16", "--phase2-output-len", "24", "--rebalance-confirm-s", "1",
                 "--rebalance-dwell-s", "2", "--result-json", str(out), "--plot-dir", str(tmp_path / "plots"),
                 "--log-dir", str(tmp_path / "logs")])
    assert code == 0
    data = json.loads(out.read_text())
    assert list(data["results"]) == ["rebalance", "1P1D", "2P1D"]
    assert data["results"]["rebalance"]["split"] == "1P2D" and "--rebalance" in data["results"]["rebalance"]["serve_flags"]
    for res in data["results"].values():
        assert [h["num_requests"] for h in res["halves"]] == [6, 6]
        assert all(h["completed"] == 6 for h in res["halves"])
    assert isinstance(data["results"]["rebalance"]["moves"], list)
    assert [row["best_static"] in ("1P1D", "2P1D") for row in data["per_half"]] == [True, True]
    assert (tmp_path / "plots" / "shift_timeline.png").exists()
    assert "| rebalance | 1 |" in capsys.readouterr().out
    assert data["settings"]["probe"] is None  # both rates given: nothing measured


@pytest.mark.slow
def test_a_rate_not_given_is_measured_on_the_two_extreme_splits_first(tmp_path):
    out = tmp_path / "shift.json"
    code = main(["--model", "tiny", "--serve-args", "--dtype float32", "--splits", "2P1D", "--phase-s", "3",
                 "--phase1-input-len", "300", "--phase1-output-len", "4", "--phase2-rate", "2",
                 "--phase2-input-len", "16", "--phase2-output-len", "24", "--rebalance-confirm-s", "1",
                 "--rebalance-dwell-s", "2", "--result-json", str(out), "--plot-dir", str(tmp_path / "plots"),
                 "--log-dir", str(tmp_path / "logs")])
    assert code == 0
    data = json.loads(out.read_text())
    probe = data["settings"]["probe"]
    first = probe["phases"][0]
    assert set(first["capacity_req_s"]) == {"2P1D", "1P2D"} and all(v > 0 for v in first["capacity_req_s"].values())
    assert data["settings"]["phases"][0]["rate"] == pytest.approx(first["rate"])
    assert data["settings"]["phases"][1]["rate"] == 2.0  # given, kept
    assert (tmp_path / "logs" / "shift_probe_2P1D.log").exists()
