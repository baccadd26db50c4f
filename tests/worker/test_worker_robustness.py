"""A worker survives what goes wrong around it: a reader that stops reading, a client that leaves a
non-streamed request, a failing transfer poll, a stalled engine under its heartbeats; and its
/health tells the truth when its engine is gone."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from pdserve import wire
from pdserve.outputs import CompletionOutput, RequestOutput
from pdserve.worker.output_stream import OutputStream
from pdserve.worker.registration import RouterMembership
from tests.http_raw import connect, head
from tests.router_server import RouterServer
from tests.wait import wait_for
from tests.worker.cluster import WorkerServer, prompt


def output(i: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(0, "", [i], "length" if finished else None,
                                                           delta_token_ids=[i])], finished)


def test_a_reader_that_falls_behind_is_cut_off():
    async def scenario():
        aborts = []
        stream = OutputStream(asyncio.get_running_loop(), lambda: aborts.append(1), max_pending=8)
        for i in range(50):  # the engine thread keeps producing; nobody reads
            stream.sink(output(i))
        await asyncio.sleep(0)
        lines = [line async for line in stream.lines(5.0, lambda: True)]
        return aborts, lines, stream._queue.qsize()

    aborts, lines, left = asyncio.run(scenario())
    assert len(aborts) == 2  # at the overflow, and again (idempotent) as the stream ends unfinished
    assert len(lines) == 1 and json.loads(lines[0])["error"]["code"] == 429
    assert left == 0


def test_keepalive_lines_while_waiting_and_an_error_when_the_engine_stops():
    async def scenario(alive: bool):
        stream = OutputStream(asyncio.get_running_loop(), lambda: None)
        got = []
        async for line in stream.lines(0.01, lambda: alive):
            got.append(line)
            if len(got) == 3:
                stream.sink(output(1, finished=True))
        return got

    alive = asyncio.run(scenario(True))
    assert alive[:3] == [b"\n"] * 3 and json.loads(alive[3])["finished"]
    dead = asyncio.run(scenario(False))
    assert len(dead) == 1 and "engine stopped" in json.loads(dead[0])["error"]["message"]


@pytest.fixture
def worker(tiny_llama):
    with WorkerServer(tiny_llama, "both", ["tcp"]) as w:
        yield w


def generate(url: str, **sampling) -> httpx.Response:
    body = {"prompt_token_ids": prompt(12), "stream": False,
            "sampling": {"temperature": 0, "max_tokens": 4, "ignore_eos": True, **sampling}}
    return httpx.post(url + "/v1/generate", json=body, timeout=60)


def test_a_failing_poll_does_not_stop_the_engine(worker, monkeypatch):
    calls = []

    def broken_poll() -> None:
        calls.append(1)
        raise RuntimeError("the transfer poll is broken")
    monkeypatch.setattr(worker.worker.loop, "poll", broken_poll)
    r = generate(worker.url)
    assert r.status_code == 200 and sum(len(line["outputs"][0]["token_ids"]) for line in r.json()) == 4
    assert calls and worker.worker.loop.alive
    assert worker.worker.stats().engine_failures > 0


def test_a_non_streaming_client_that_leaves_aborts_its_request(worker, monkeypatch):
    w = worker.worker
    step = w.engine.step

    def paced_step():  # the tiny model decodes 500 tokens in well under a second: give the server
        time.sleep(0.002)  # (its event loop sharing 2 cores with the engine thread) time to see the client go
        return step()
    monkeypatch.setattr(w.engine, "step", paced_step)
    gate, held = threading.Event(), threading.Event()
    w.loop.call(lambda: (held.set(), gate.wait(30)))
    # the engine thread inside the gate: the queued call counted below is the request's, not the gate's
    wait_for(held.is_set, 30, "the engine thread held")
    body = json.dumps({"prompt_token_ids": prompt(12), "stream": False,
                       "sampling": {"max_tokens": 500, "ignore_eos": True}}).encode()
    sock = connect(worker.url)
    sock.sendall(head("POST", "/v1/generate", "Content-Type: application/json", f"Content-Length: {len(body)}") + body)
    wait_for(lambda: w.loop._calls.qsize() >= 1, 30, "the request in, waiting for the engine")
    sock.close()
    gate.set()
    wait_for(lambda: w.stats().requests_aborted == 1, 30, "the abort", state=lambda: w.stats().num_steps)
    wait_for(worker.is_idle, 30, "an idle worker")
    assert w.stats().num_steps < 500  # it never ran to its max_tokens


def test_a_burst_waits_for_the_engine_without_holding_threads(worker):
    """Requests the engine has not yet taken wait on the engine thread's queue, not on a thread
    pool: with the engine held, many more than the pool's size are in, and each is taken once
    the engine turns (the pool's few threads would let a burst queue for minutes unheard)."""
    w = worker.worker
    gate = threading.Event()
    w.loop.call(lambda: gate.wait(30))
    burst = 48
    threads_before = threading.active_count()
    results: list[httpx.Response] = []

    async def send_all() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(i: int) -> None:
                body = {"prompt_token_ids": prompt(8 + i % 5), "stream": False,
                        "sampling": {"temperature": 0, "max_tokens": 2, "ignore_eos": True}}
                results.append(await client.post(worker.url + "/v1/generate", json=body))
            await asyncio.gather(*(one(i) for i in range(burst)))

    sender = threading.Thread(target=asyncio.run, args=(send_all(),))
    sender.start()
    wait_for(lambda: w.loop._calls.qsize() >= burst, 30, "every request waiting for the engine")
    grown = threading.active_count() - threads_before
    gate.set()
    sender.join(60)
    assert not sender.is_alive()
    assert grown < 8, f"{grown} threads waited for the engine"
    assert [r.status_code for r in results] == [200] * burst
    wait_for(worker.is_idle, 30, "an idle worker")


def test_a_request_the_engine_did_not_take_in_time_never_runs(worker, monkeypatch):
    from pdserve.worker import worker as worker_module

    w = worker.worker
    monkeypatch.setattr(worker_module, "ADMIT_TIMEOUT_S", 0.2)
    gate = threading.Event()
    w.loop.call(lambda: gate.wait(30))
    try:
        r = generate(worker.url)
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded"
    finally:
        gate.set()
    wait_for(lambda: w.loop._calls.qsize() == 0, 30, "the engine's queue drained")
    stats = w.stats()
    assert stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0
    assert generate(worker.url).status_code == 200


def test_stats_do_not_wait_for_a_stalled_engine(worker):
    w = worker.worker
    fresh = w.stats()
    assert fresh.engine_alive and not fresh.stale
    gate = threading.Event()
    w.loop.call(lambda: gate.wait(30))
    try:
        stale = w.stats()  # answers from the last snapshot instead of waiting
        assert stale.stale and stale.kv_blocks_total == fresh.kv_blocks_total
    finally:
        gate.set()
    assert not w.stats().stale


def test_heartbeats_survive_a_stats_call_that_fails(tiny_llama):
    failures = [TimeoutError("the engine did not answer in time"), RuntimeError("boom")]

    def stats() -> wire.WorkerStats:
        if failures:
            raise failures.pop(0)
        return wire.WorkerStats(role="decode", running=0, kv_blocks_total=8)
    with RouterServer(tiny_llama) as rs:
        router = rs.router
        member = RouterMembership(rs.url, "http://127.0.0.1:5", "decode", router.registry.model_hash, stats).start()
        try:
            wait_for(lambda: router.registry.workers() and router.registry.workers()[0].heartbeats > 0
                     and member.status == "registered", 30, "a heartbeat after the failures")
            assert not failures
        finally:
            member.stop()


def test_a_heartbeat_reaches_only_an_entry_of_the_role_it_reports(tiny_llama):
    """A role change lands in the worker's stats on the thread that changes it, and may reach the
    heartbeat thread before the membership is told. That heartbeat (new role, no longer draining)
    must not renew the entry of the old role: the router would route decode work to a worker
    that now refuses it. The worker registers again in the role its stats report."""
    now = {"role": "decode", "draining": True}

    def stats() -> wire.WorkerStats:
        return wire.WorkerStats(role=now["role"], draining=now["draining"], kv_blocks_total=8)
    with RouterServer(tiny_llama) as rs:
        registry, url = rs.router.registry, "http://127.0.0.1:5"
        member = RouterMembership(rs.url, url, "decode", registry.model_hash, stats).start()
        try:
            wait_for(lambda: [e.heartbeats for e in registry.workers()] == [1], 30, "the first heartbeat")
            now.update(role="prefill", draining=False)  # changed, and the membership not told yet
            member.beat_now()
            wait_for(lambda: any(e.stats.role == "prefill" for e in registry.workers()), 30,
                     "a heartbeat of the new role", state=registry.workers)
            entries = registry.workers()
            assert [(e.url, e.role, e.stats.role) for e in entries] == [(url, "prefill", "prefill")]
        finally:
            member.stop()


def test_health_says_when_the_engine_is_gone(worker):
    assert httpx.get(worker.url + "/health").status_code == 200
    worker.worker.loop.stop()
    r = httpx.get(worker.url + "/health")
    assert r.status_code == 503 and r.json()["status"] == "engine stopped"
