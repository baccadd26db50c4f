"""`pdserve bench chaos` end to end on the tiny model: KV links cut, a worker frozen, a worker killed,
under load. No request may be lost, no KV block left in use, every request accounted for, and
the faults must really have happened (the supervisor saw the kill, the cut closed links)."""

from __future__ import annotations

from pdserve.bench.chaos.plan import PlannedFault
from pdserve.bench.chaos.run import SeededWorkload, audit, parse_args, run_once


def test_a_chaos_run_loses_nothing_and_leaks_nothing(tiny_llama, tmp_path):
    args = parse_args(["--model", str(tiny_llama), "--duration", "4", "--concurrency", "2", "--input-len", "300",
                       "--output-len", "8", "--request-timeout", "60", "--recovery-timeout", "90", "--grace", "30",
                       "--max-restart-backoff", "1", "--serve-args", "--dtype float32 --kv-cache-memory 8MiB",
                       "--server-log-dir", str(tmp_path)])
    plan = [PlannedFault(0.5, "cut-kv", "prefill worker 0"), PlannedFault(1.0, "freeze-worker", "decode worker 1", 1.0),
            PlannedFault(1.5, "kill-worker", "decode worker 1")]
    run = run_once("faults", args, SeededWorkload(args), lambda duration: plan)
    log = (tmp_path / "bench_chaos_faults_server.log").read_text()[-3000:]
    assert audit(run, workers=2, rolling=False) == [], log
    assert run["outcomes"]["lost"] == 0 and run["unaccounted"] == 0
    assert run["outcomes"]["ok"] > 0 and len(run["requests"]) == sum(run["outcomes"].values())
    assert run["kv_blocks_in_use_at_end"] == 0 and not run["busy_at_end"]
    causes = run["errors_by_cause"]  # each error has one cause
    assert causes["refused"] + causes["in_flight"] + causes["later"] == run["outcomes"]["error"], causes
    cut, freeze, kill = run["faults"]
    assert cut["reported"]["sender_links"] >= 1 and not cut["error"]  # the warm-up opened a link; it was cut
    assert freeze["resumed_s"] > freeze["injected_s"]
    kinds = [(e["event"], e["name"]) for e in run["events"]]
    assert ("exited", "decode worker 1") in kinds and ("ready_again", "decode worker 1") in kinds
    assert next(e for e in run["events"] if e["event"] == "exited")["code"] == -9
    assert all(f["recovery"]["recovered"] for f in run["faults"]) and run["unexpected_exits"] == []
