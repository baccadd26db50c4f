"""One conformance suite for every backend: aborts at each stage, a side lost mid-transfer, and
after each case every block on both sides free again."""

from __future__ import annotations

import threading

import httpx
import pytest

from pdserve import SamplingParams
from pdserve.engine.request import RequestStatus
from tests.factories import make_llm
from tests.wait import wait_for
from tests.worker.cluster import CASES, CASES_WITH_MEMORY, Cluster, HeldAtToken, prompt

LONG = 120  # 4 prefill chunks of 32 tokens


@pytest.fixture(scope="module")
def colocated(tiny_llama):
    return make_llm(tiny_llama, block_size=4)


def expected(llm, tokens, max_tokens=8):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate({"prompt_token_ids": tokens}, sp)[0].outputs[0].token_ids


def gate_after_first_step(worker) -> tuple[threading.Event, threading.Event]:
    """Hold the prefill worker's engine after its first step's KV went out."""
    reached, release = threading.Event(), threading.Event()
    role = worker.prefill
    original = role.after_execute

    def after_execute(step):
        original(step)
        if not reached.is_set():
            reached.set()
            release.wait(20)
    role.after_execute = after_execute
    return reached, release


def start_stream(c: Cluster, tokens, **kw):
    """A request streaming in the background; returns (thread, box with tokens or error). Every
    test reads its outcome with `outcome`."""
    box: dict = {}

    def run():
        try:
            box["tokens"], box["last"] = c.generate(tokens, **kw)
        except Exception as e:
            box["error"] = e
    t = threading.Thread(target=run)
    t.start()
    return t, box


def outcome(stream: threading.Thread, box: dict, timeout: float = 30) -> tuple[list[int], str]:
    """The stream's tokens and finish reason, once it ended (the timeout only bounds a hang)."""
    stream.join(timeout)
    assert not stream.is_alive(), f"the stream had not ended after {timeout:.0f}s"
    assert "error" not in box, f"the stream failed: {box.get('error')!r}"
    return box["tokens"], box["last"]["outputs"][0]["finish_reason"]


def abort_the_waiting_request(c: Cluster, stream: threading.Thread, box: dict) -> None:
    """Abort, through decode's endpoint, the request awaiting its KV; its stream ends with 'abort'."""
    rid = next(iter(c.d.worker.engine.scheduler.waiting_for_kv))
    c.http.post(c.d.url + "/v1/abort", json={"request_id": rid})
    assert outcome(stream, box) == ([], "abort")  # no token: its KV never landed


@pytest.mark.parametrize("backend", CASES_WITH_MEMORY)
def test_abort_while_prefill_is_queued(tiny_llama, backend):
    with Cluster(tiny_llama, backend) as c:
        hold = threading.Event()
        c.p.worker.loop.call(lambda: hold.wait(20))  # the prefill engine is busy
        t, box = start_stream(c, prompt(LONG), max_tokens=4)
        wait_for(lambda: c.d.worker.engine.scheduler.waiting_for_kv, 10, "the request waiting for its KV")
        abort_the_waiting_request(c, t, box)
        hold.set()
        c.wait_idle()


@pytest.mark.parametrize("backend", CASES_WITH_MEMORY)
def test_abort_during_transfer(tiny_llama, backend):
    with Cluster(tiny_llama, backend) as c:
        reached, release = gate_after_first_step(c.p.worker)
        t, box = start_stream(c, prompt(LONG), max_tokens=4)
        assert reached.wait(20)  # the first chunk's layers are in decode's blocks
        abort_the_waiting_request(c, t, box)
        release.set()
        c.wait_idle()


@pytest.mark.parametrize("backend", CASES_WITH_MEMORY)
def test_client_disconnect_during_decode(tiny_llama, backend):
    with Cluster(tiny_llama, backend) as c, HeldAtToken(c.d.worker, num_tokens=6) as held:
        with c.http.stream("POST", c.d.url + "/v1/generate", json=c.body(prompt(30), max_tokens=500)) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            assert held.reached.wait(30), "decode never reached the request's 6th token"
        # the client is gone while decode cannot run on: only an abort can end the request early
        assert held.aborts.wait(30), "the worker never aborted the request its client left"
        held.release.set()
        c.wait_idle()
        assert held.request.status == RequestStatus.FINISHED_ABORTED
        assert len(held.request.output_token_ids) == held.num_tokens + 1  # of 500
        assert c.d.worker.stats().requests_aborted == 1


@pytest.mark.parametrize("backend", CASES_WITH_MEMORY)
def test_prefill_lost_mid_transfer_decode_recomputes(tiny_llama, colocated, backend):
    tokens = prompt(LONG, seed=2)
    with Cluster(tiny_llama, backend) as c:
        reached, release = gate_after_first_step(c.p.worker)
        t, box = start_stream(c, tokens)
        assert reached.wait(20)
        for sender in list(c.p.worker.prefill._senders.values()):
            sender.close()  # the prefill worker's side of the link goes down
        assert outcome(t, box) == (expected(colocated, tokens), "length")  # decode computed the prompt itself
        assert c.d.worker.stats().kv_recomputed == 1
        release.set()
        c.wait_idle()


@pytest.mark.parametrize("backend", CASES_WITH_MEMORY)
def test_unreachable_prefill_worker_means_recompute(tiny_llama, colocated, backend):
    tokens = prompt(33, seed=5)
    with Cluster(tiny_llama, backend) as c:
        body = c.body(tokens)
        body["prefill_url"] = "http://127.0.0.1:9"  # nothing listens there
        r = c.http.post(c.d.url + "/v1/generate", json={**body, "stream": False})
        got = [t for line in r.json() for t in line["outputs"][0]["token_ids"]]
        assert got == expected(colocated, tokens)
        c.wait_idle()


@pytest.mark.parametrize("backend", CASES)
def test_decode_lost_mid_transfer_prefill_frees(tiny_llama, colocated, backend):
    tokens = prompt(LONG, seed=3)
    with Cluster(tiny_llama, backend) as c:
        reached, release = gate_after_first_step(c.p.worker)
        t, box = start_stream(c, tokens, max_tokens=4)
        assert reached.wait(20)
        c.d.worker.receiver.close()  # decode's KV side goes down
        wait_for(lambda: not any(s.alive for s in c.p.worker.prefill._senders.values()), 10,
                 "every prefill sender closed")
        release.set()
        assert outcome(t, box) == (expected(colocated, tokens, 4), "length")  # decode computed the prompt itself
        c.wait_idle()  # prefill aborted its request and freed its blocks
        assert c.p.worker.prefill.num_notified == 0
        assert c.d.worker.stats().kv_recomputed == 1


def test_lease_timeout_falls_back_to_recompute(tiny_llama, colocated):
    tokens = prompt(50, seed=9)
    with Cluster(tiny_llama, "memory", decode_worker={"kv_lease_timeout": 0.5}) as c:
        hold = threading.Event()
        c.p.worker.loop.call(lambda: hold.wait(20))  # prefill never gets to it in time
        got, _ = c.generate(tokens)
        assert got == expected(colocated, tokens)
        hold.set()
        c.wait_idle()
        assert c.d.worker.stats().kv_recomputed == 1


def test_token_required_everywhere(tiny_llama, colocated):
    tokens = prompt(20)
    with Cluster(tiny_llama, "tcp", token="s3cret") as c:
        assert c.generate(tokens)[0] == expected(colocated, tokens)
        r = httpx.post(c.d.url + "/v1/generate", json=c.body(tokens))
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(c.d.url + "/health").status_code == 200
        c.wait_idle()


def test_model_mismatch_is_refused_and_decode_recomputes(tiny_models, colocated):
    from tests.worker.cluster import WorkerServer

    tokens = prompt(21, seed=4)
    p = WorkerServer(tiny_models["qwen2"], "prefill", ["tcp"])
    d = WorkerServer(tiny_models["llama"], "decode", ["tcp"])
    try:
        body = {"prompt_token_ids": tokens, "prefill_url": p.url, "stream": False,
                "sampling": {"temperature": 0, "max_tokens": 8, "ignore_eos": True}}
        got = httpx.post(d.url + "/v1/generate", json=body, timeout=60).json()
        assert [t for line in got for t in line["outputs"][0]["token_ids"]] == expected(colocated, tokens)
        assert d.worker.stats().kv_recomputed == 1
        lease = {"request_id": "x", "fence": 1, "prompt_token_ids": tokens, "sampling": {}, "start": 0,
                 "block_table": [0] * 6, "block_size": 4, "model_hash": d.worker.layout.model_hash,
                 "decode": d.worker.offers}
        r = httpx.post(p.url + "/v1/prefill", json=lease)
        assert r.status_code == 409 and "model mismatch" in r.json()["error"]["message"]
    finally:
        p.stop()
        d.stop()
