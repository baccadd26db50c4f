"""`pdserve bench soak`: how outcomes are judged, the audit's checks, and one short real soak on the
tiny model (every kind of action runs; nothing fails; nothing goes unaccounted)."""

from __future__ import annotations

import json
import os
import socket

import httpx
import openai
import pytest

from pdserve.bench.soak.run import main
from pdserve.bench.soak.actions import ACTIONS, first_round
from pdserve.bench.soak.audit import Metrics, audit
from pdserve.bench.soak.outcomes import SERVED, Expect, Ledger, classify_exception, classify_response
from pdserve.bench.soak.target import Reference
from pdserve.bench.soak.valid import Draw, Reply, check

ERROR = json.dumps({"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": 400}}).encode()
RETRY = {"retry-after": "1"}


# -- judging one request -----------------------------------------------------------------------

def test_a_server_error_is_a_failure_even_in_the_openai_shape():
    for status in (500, 502, 503):
        out = classify_response(status, RETRY, ERROR, SERVED)
        assert not out.ok and out.label == str(status) and "server error" in out.failure


def test_an_expected_refusal_needs_the_openai_shape():
    assert classify_response(400, {}, ERROR, Expect.of(400)).ok
    for body in (b"Invalid HTTP request received.", b'{"detail": "bad"}', b'{"error": "bad"}', b""):
        out = classify_response(400, {}, body, Expect.of(400))
        assert not out.ok and out.label == "400 not OpenAI-shaped"


def test_the_wrong_status_is_a_failure_and_a_malformed_request_answered_200_too():
    assert not classify_response(404, {}, ERROR, Expect.of(400)).ok
    out = classify_response(200, {}, b"{}", Expect.of(400))
    assert not out.ok and "unexpected status" in out.failure


def test_429_is_fine_for_a_valid_request_only_with_retry_after():
    assert classify_response(429, RETRY, ERROR, SERVED).ok
    assert classify_response(429, {}, ERROR, SERVED).label == "429 without Retry-After"
    assert not classify_response(429, RETRY, ERROR, Expect.of(400)).ok  # validation comes before the queue


def test_a_closed_connection_is_an_answer_only_for_connection_level_abuse():
    for exc in (ConnectionResetError(), BrokenPipeError(), httpx.RemoteProtocolError("gone"),
                openai.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1/"))):
        assert classify_exception(exc, Expect.of(408, closed_ok=True), 5).ok
        out = classify_exception(exc, SERVED, 5)
        assert out.label == "closed" and not out.ok


def test_a_hang_is_a_failure_whatever_the_action():
    for exc in (socket.timeout(), TimeoutError(), httpx.ReadTimeout("slow"),
                openai.APITimeoutError(request=httpx.Request("POST", "http://127.0.0.1/"))):
        out = classify_exception(exc, Expect.of(408, closed_ok=True), 5)
        assert out.label == "hang" and not out.ok


def test_the_ledger_judges_exceptions_and_leaves_unjudged_requests_unaccounted():
    ledger = Ledger(timeout_s=5)
    with ledger.request("a", SERVED) as slot:
        slot.outcome = classify_response(200, {}, b"{}", SERVED)
    with ledger.request("a", SERVED):
        raise ConnectionResetError()
    with ledger.request("b", SERVED):
        pass  # a flaw of the soak: nobody judged it
    ledger.crash("c", ValueError("oops"), "traceback")
    rows = ledger.table()
    assert rows["a"] == {"opened": 2, "outcomes": {"200": 1, "closed": 1}, "failed": {"closed": 1}, "failures": 1,
                         "unaccounted": 0}
    assert rows["b"]["unaccounted"] == 1 and rows["c"]["failed"] == {"soak error": 1}
    assert ledger.totals() == (4, 3, 2)
    assert [s["outcome"] for s in ledger.samples] == ["closed", "soak error"]


# -- judging an answer -------------------------------------------------------------------------

def test_a_greedy_answer_must_match_its_reference_cut_at_the_stop_string():
    ref = Reference(chat=False, prompt="p", max_tokens=8, text="Paris is the capital.", finish_reason="length")
    assert ref.expected(None) == ("Paris is the capital.", "length")
    assert ref.expected("the") == ("Paris is ", "stop")
    assert ref.expected("absent") == ("Paris is the capital.", "length")
    draw = Draw(False, {"n": 2, "max_tokens": 8}, expected=ref.expected("the"))
    right = Reply({0: "Paris is ", 1: "Paris is "}, {0: "stop", 1: "stop"}, {"completion_tokens": 6})
    assert check(right, draw) is None
    wrong = Reply({0: "Paris is ", 1: "Lyon is "}, {0: "stop", 1: "stop"})
    assert "differs from the reference" in check(wrong, draw)


def test_an_answer_needs_every_choice_a_finish_reason_done_and_sane_usage():
    draw = Draw(False, {"n": 2, "max_tokens": 4})
    assert "choices" in check(Reply({0: "a"}, {0: "length"}), draw)
    assert "finish reasons" in check(Reply({0: "a", 1: "b"}, {0: "length", 1: None}), draw)
    assert "DONE" in check(Reply({0: "a", 1: "b"}, {0: "stop", 1: "stop"}, done=False), draw)
    assert "usage" in check(Reply({0: "a", 1: "b"}, {0: "stop", 1: "stop"}, {"completion_tokens": 9}), draw)
    exact = Draw(False, {"n": 1, "max_tokens": 4}, exact_tokens=True)
    assert "EOS ignored" in check(Reply({0: "a"}, {0: "stop"}), exact)
    assert check(Reply({0: "abcd"}, {0: "length"}, {"completion_tokens": 4}), exact) is None


def test_the_first_round_covers_every_kind_once_with_the_burst_last():
    for clients in (1, 4, 12, 40):
        rounds = [first_round(i, clients) for i in range(clients)]
        assert sorted(a.name for r in rounds for a in r) == sorted(a.name for a in ACTIONS)
        assert all(a.name != "abuse.burst" for r in rounds for a in r[:-1])


# -- the audit ---------------------------------------------------------------------------------

def _metrics(used: int = 0, running: int = 0, queue: int = 0, dropped: int = 0, decode: int = 1) -> Metrics:
    return Metrics.parse(f"""# HELP pdserve_workers registered workers
pdserve_workers{{role="prefill"}} 1.0
pdserve_workers{{role="decode"}} {decode}.0
pdserve_workers{{role="both"}} 0.0
pdserve_workers_dropped_total {dropped}.0
pdserve_queue_requests {queue}.0
pdserve_requests_total{{outcome="ok"}} 12.0
pdserve_worker_kv_blocks_used{{role="prefill",worker="w1"}} 0.0
pdserve_worker_kv_blocks_used{{role="decode",worker="w2"}} {used}.0
pdserve_worker_running{{role="decode",worker="w2"}} {running}.0
pdserve_worker_waiting{{role="decode",worker="w2"}} 0.0
pdserve_worker_waiting_for_kv{{role="decode",worker="w2"}} 0.0
""")


def _audit(rows=None, failures=0, end=None, growth=100.0, pids=None):
    rows = rows or {"valid.chat.httpx": {"opened": 3, "unaccounted": 0}}
    memory = {"baseline_mib": 1000.0, "peak_mib": 1000.0 + growth, "bound_mib": 512.0}
    checks = audit(rows, failures, _metrics(), end or _metrics(), 2.0, 30.0, memory, pids or {"me": os.getpid()})
    return {c.name: c for c in checks}


def test_the_audit_passes_a_clean_run():
    checks = _audit()
    assert all(c.passed for c in checks.values()), checks
    assert set(checks) == {"every request accounted for", "no failures", "idle after the grace period",
                           "no worker dropped", "memory growth within bound", "cluster processes alive"}


def test_the_audit_names_each_check_that_fails():
    assert not _audit(rows={"x": {"opened": 3, "unaccounted": 1}})["every request accounted for"].passed
    assert not _audit(failures=1)["no failures"].passed
    held = _audit(end=_metrics(used=7, running=1))["idle after the grace period"]
    assert not held.passed and "w2 (decode) kv_blocks_used" in held.detail
    assert not _audit(end=_metrics(queue=2))["idle after the grace period"].passed
    assert not _audit(end=_metrics(dropped=1))["no worker dropped"].passed
    assert not _audit(end=_metrics(decode=0))["no worker dropped"].passed  # fewer workers, whatever the counter says
    assert not _audit(growth=600.0)["memory growth within bound"].passed
    assert not _audit(pids={"gone": 2 ** 22 + 1})["cluster processes alive"].passed  # past Linux's largest pid


def test_metrics_parse_labels_and_sums():
    m = _metrics(used=3)
    assert m.workers() == {"prefill": 1, "decode": 1}
    assert m.value("pdserve_worker_kv_blocks_used") == 3
    assert m.value("pdserve_worker_kv_blocks_used", role="prefill") == 0
    assert m.summary()["requests"] == {"ok": 12.0}


# -- a real soak -------------------------------------------------------------------------------

def test_a_short_soak_runs_every_kind_and_passes_its_audit(tiny_llama, tmp_path, capsys):
    out, plots, log = tmp_path / "soak.json", tmp_path / "plots", tmp_path / "server.log"
    # The burst is the router's queue + 64: past the queue some get 429, and the rest are served in
    # full, many more than a worker runs at once
    code = main(["--model", str(tiny_llama), "--serve-args", "--dtype float32 --kv-cache-memory 8MiB --max-num-seqs 8",
                 "--duration", "15", "--concurrency", "4", "--stall-hold", "3", "--router-queue", "136", "--grace", "20",
                 "--result-json", str(out), "--plot-dir", str(plots), "--server-log", str(log)])
    result = json.loads(out.read_text())
    assert code == 0, (result["audit"], result["failures"][:3])
    assert result["audit"]["passed"] and all(c["passed"] for c in result["audit"]["checks"])
    assert set(result["kinds_run"]) == {a.name for a in ACTIONS}
    rows = result["actions"]
    assert all(row["opened"] >= 1 and row["failures"] == 0 and row["unaccounted"] == 0 for row in rows.values())
    burst = rows["abuse.burst"]["outcomes"]
    assert sum(burst.values()) == 200 and set(burst) == {"200", "429"} and burst["200"] >= 136 - 4
    assert set(rows["malformed.wrong_key"]["outcomes"]) == {"401"}
    assert result["memory"]["samples"] and result["memory"]["bound_mib"] == 512
    assert result["settings"]["api_key"].startswith("random") and "PDSERVE_API_KEY" in result["settings"]["api_key"]
    assert len(result["references"]) == 6
    assert (plots / "soak_memory.png").exists() and (plots / "soak_outcomes.png").exists()
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].startswith("soak ") and ": PASS:" in printed.splitlines()[0]
    assert "| abuse.slowloris |" in printed and "ok   no worker dropped" in printed


@pytest.mark.parametrize("argv", [["--duration", "0"], ["--concurrency", "0"], ["--stall-hold", "-1"]])
def test_bad_settings_are_refused(argv):
    with pytest.raises(SystemExit):
        main(argv)
