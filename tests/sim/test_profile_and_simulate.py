"""Fitting the performance model, and `pdserve simulate` end to end on a synthetic profile."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.workload.loadgen import LengthDist, WorkloadSpec, build_requests
from pdserve.sim.cluster import SimCluster
from pdserve.sim.perf import LinearPerfModel, StepShape
from pdserve.sim.profile import fit_link, fit_steps, perf_model
from pdserve.sim.simulate import main, simulate_point

TRUE = LinearPerfModel(base_s=0.004, prefill_token_s=2e-4, prefill_attention_s=1e-8, decode_seq_s=1e-3,
                       decode_context_s=2e-6)


def test_the_fit_recovers_a_known_model():
    rng = random.Random(0)
    shapes = [StepShape(rng.choice([0, 64, 256, 512]), rng.randrange(0, 2048), rng.randrange(0, 17),
                        rng.randrange(0, 8000)) for _ in range(200)]
    samples = [(s, TRUE.step_time(s)) for s in shapes if s.prefill_tokens or s.decode_seqs]
    coef, error = fit_steps(samples)
    assert error < 1e-6
    for name, value in coef.items():
        assert value == pytest.approx(getattr(TRUE, name), rel=1e-4, abs=1e-12)
    assert all(v >= 0 for v in coef.values())


def test_a_profile_from_steps_logged_while_serving(tmp_path):
    from dataclasses import asdict

    from pdserve.sim.profile import main as profile_main

    rng = random.Random(1)
    shapes = [StepShape(rng.choice([0, 128, 512]), rng.randrange(0, 1024), rng.randrange(1, 9),
                        rng.randrange(100, 4000)) for _ in range(60)]
    log = tmp_path / "decode-1.jsonl"
    rows = [{**asdict(s), "seconds": TRUE.step_time(s), "cpu_seconds": 0.8 * TRUE.step_time(s), "at": 1e9 + i}
            for i, s in enumerate(shapes)]
    log.write_text("".join(json.dumps(row) + "\n" for row in rows))
    machine = tmp_path / "machine.json"
    machine.write_text(json.dumps({"model": "m", "kv_bytes_per_token": 1000,
                                   "links": {"shm": {"latency_s": 1e-4, "bytes_per_s": 1e10}}}))
    out = tmp_path / "serving.json"
    assert profile_main(["--from-steps", str(log), "--links-from", str(machine), "--out", str(out)]) == 0
    profile = json.loads(out.read_text())
    assert profile["engine_cpu_share"] == pytest.approx(0.8)  # the engine thread waited a fifth of its steps
    model = perf_model(profile)
    assert model.decode_seq_s == pytest.approx(TRUE.decode_seq_s, rel=1e-3)
    assert model.kv_bytes_per_token == 1000 and model.link_bytes_per_s == 1e10
    log.write_text("not json\n")
    with pytest.raises(SystemExit) as e:
        profile_main(["--from-steps", str(log), "--links-from", str(machine)])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        profile_main(["--from-steps", str(log)])  # the KV size and links must come from somewhere


def test_the_fit_keeps_coefficients_non_negative():
    # times that fall with decode context would want a negative coefficient: it is dropped instead
    samples = [(StepShape(decode_seqs=1, decode_context=c), 0.01 - c * 1e-7) for c in range(0, 10000, 500)]
    coef, _ = fit_steps(samples)
    assert all(v >= 0 for v in coef.values())


def test_link_fit():
    assert fit_link([(1000, 0.002), (11000, 0.012)]) == pytest.approx({"latency_s": 0.001, "bytes_per_s": 1e6})
    assert fit_link([(1000, 0.002), (2000, 0.001)]) == {"latency_s": 0.0, "bytes_per_s": 2e6}  # noise: a bound


def profile_json(tmp_path):
    profile = {"model": "synthetic", "kv_bytes_per_token": 1000,
               "step": {k: getattr(TRUE, k) for k in ("base_s", "prefill_token_s", "prefill_attention_s",
                                                      "decode_seq_s", "decode_context_s")},
               "links": {"shm": {"latency_s": 0.001, "bytes_per_s": 1e9}}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    return path, profile


def test_concurrency_caps_requests_in_flight(tmp_path):
    _, profile = profile_json(tmp_path)
    model = perf_model(profile)
    spec = WorkloadSpec(12, LengthDist.parse("100-300"), LengthDist.parse("5-20"), seed=1, vocab_size=500)
    records = simulate_point(lambda: SimCluster(model, model, num_colocated=1), build_requests(spec),
                             float("inf"), 1, 1.0, 1)
    spans = sorted((r.start, r.end) for r in records)
    assert all(r.ok for r in records)
    assert all(a_end <= b_start + 1e-12 for (_, a_end), (b_start, _) in zip(spans, spans[1:]))  # one at a time


def test_sessions_take_turns_and_later_turns_find_their_prefix(tmp_path):
    """Sessions of three turns, all arriving at once: each later turn is sent its previous turn's
    end plus the think time after, and starts from its prefix in the worker's cache."""
    _, profile = profile_json(tmp_path)
    model = perf_model(profile)
    spec = WorkloadSpec(12, LengthDist.parse("600"), LengthDist.parse("8"), seed=2, vocab_size=500, turns=3,
                        think_time=0.25)
    requests = build_requests(spec)
    made = []
    records = simulate_point(lambda: made.append(SimCluster(model, model, num_colocated=1)) or made[-1], requests,
                             float("inf"), None, 1.0, 1)
    assert all(r.ok for r in records)
    for req, rec in zip(requests, records):
        if req.turn:
            previous = records[requests.index(next(q for q in requests if (q.session, q.turn) == (req.session,
                                                                                                req.turn - 1)))]
            assert rec.start >= previous.end + 0.25 - 1e-9
    (worker,) = made[0].decodes  # the colocated worker
    by_source = worker.scheduler.tokens_by_source
    later = sum(len(r.prompt) for r in requests if r.turn)
    assert by_source["prefix_cache"] >= later - sum(600 + 16 for r in requests if r.turn)  # all but each turn's new part
    assert by_source["computed"] + by_source["prefix_cache"] == sum(len(r.prompt) for r in requests)


def test_simulate_command(tmp_path, capsys):
    path, _ = profile_json(tmp_path)
    out = tmp_path / "sim.json"
    code = main(["--profile", str(path), "--prefill", "1", "--decode", "1", "--num-requests", "30",
                 "--request-rate", "2,4", "--input-len", "1024+-128", "--output-len", "32", "--vocab-size", "500",
                 "--result-json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert [r["load"]["request_rate"] for r in result["runs"]] == [2, 4]
    for run in result["runs"]:
        # floors from the profile: a prompt of 896+ tokens takes 4 ms + 896 x 0.2 ms to prefill, a decode
        # step 4 ms + 1 ms a sequence
        assert run["completed"] == 30 and run["ttft"]["p50"] >= 183.2 and run["tpot"]["p50"] >= 5.0
    assert "| load |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--profile", str(tmp_path / "missing.json")])


def test_simulate_a_projected_cluster(tmp_path):
    out = tmp_path / "sim.json"
    code = main(["--gpu", "A100-80G", "--model-spec", "llama-3-70b", "--tp-prefill", "2", "--tp-decode", "2",
                 "--weight-bits", "4", "--prefill", "2", "--decode", "2", "--num-requests", "40", "--concurrency", "32",
                 "--input-len", "2048", "--output-len", "128", "--result-json", str(out)])
    assert code == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["completed"] == 40 and run["tpot"]["p50"] > 5  # a 70B decode step takes milliseconds, not less
    assert json.loads(out.read_text())["settings"]["projection"]["gpu"] == "A100-80G"
    with pytest.raises(SystemExit):
        main(["--gpu", "nonexistent"])
    with pytest.raises(SystemExit):
        main([])


def test_speculation_scales_decode_steps_by_the_tokens_a_draft_gives():
    """Decode-only steps verify the draft length that gives the most tokens a second: at one
    sequence, where a row is cheap against the step, many; at a large batch, none."""
    plain = LinearPerfModel(base_s=0.010, decode_seq_s=0.0005, decode_context_s=1e-7)
    spec = plain.speculating(0.8, 8)
    one = StepShape(decode_seqs=1, decode_context=500)
    # a token of one sequence: best k verified, t(1 + k rows) / (1 + 0.8 + ... + 0.8^k)
    best = min(plain._rows_time(one, 1 + k) / sum(0.8 ** j for j in range(k + 1)) for k in range(9))
    assert spec.step_time(one) == pytest.approx(best) and best < plain.step_time(one) / 2.5
    big = StepShape(decode_seqs=256, decode_context=256 * 500)  # rows dominate: drafting does not pay
    assert spec.step_time(big) == pytest.approx(plain.step_time(big))
    mixed = StepShape(prefill_tokens=100, prefill_context=50, decode_seqs=1, decode_context=500)
    assert spec.step_time(mixed) == plain.step_time(mixed)
    assert plain.speculating(0.0, 8).step_time(one) == plain.step_time(one)
    with pytest.raises(ValueError):
        plain.speculating(1.0, 8)


def test_simulate_with_speculation_decodes_faster(tmp_path):
    path, _ = profile_json(tmp_path)
    tpot = {}
    for acceptance in ("0", "0.7"):
        out = tmp_path / f"sim{acceptance}.json"
        assert main(["--profile", str(path), "--colocated", "1", "--decode", "0", "--prefill", "0",
                     "--num-requests", "10", "--concurrency", "1", "--input-len", "128", "--output-len", "64",
                     "--vocab-size", "500", "--draft-acceptance", acceptance, "--result-json", str(out)]) == 0
        tpot[acceptance] = json.loads(out.read_text())["runs"][0]["tpot"]["p50"]
    assert tpot["0.7"] < tpot["0"] / 1.3  # a row costs a quarter of a step here: drafts of a few tokens
    with pytest.raises(SystemExit):
        main(["--profile", str(path), "--draft-acceptance", "1.2"])
