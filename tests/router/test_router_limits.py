"""One request never hurts another at the router: bad values stop at the edge, a request the
client abandoned stops everywhere, a silent or failed worker ends the streams it held, and the
router's metrics show every worker's pool."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import pytest
from fastapi import FastAPI

from pdserve.http_clients import StallGuardedStreamingResponse
from pdserve.router.streams import LiveStream, WorkerLost
from pdserve.worker.server import ServerThread
from tests.http_raw import connect, head
from tests.router_server import MODEL, RouterServer, make_router
from tests.wait import wait_for
from tests.worker.cluster import WorkerServer


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    with WorkerServer(tiny_llama, "decode", ["tcp"], block_size=8) as d, RouterServer(tiny_llama) as rs:
        rs.join(d)
        yield {"url": rs.url, "router": rs.router, "d": d}


def completion(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)


def test_the_request_that_broke_the_engine_fails_alone(cluster):
    bad = completion(cluster["url"], prompt="hello", n=2, seed=18446744073709551615, max_tokens=3000,
                     ignore_eos=True)
    assert bad.status_code == 400 and "seed" in bad.json()["error"]["message"]
    good = completion(cluster["url"], prompt="hello", max_tokens=4, temperature=0, ignore_eos=True)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 4
    wait_for(cluster["d"].is_idle, 30, "idle decode worker")


def test_a_request_that_finds_every_queue_full_waits_in_the_router(cluster, monkeypatch):
    """The router admitted it: a worker's 503 (queue full) before the first token means wait and
    ask again, not an error, and the answer is the one an uncontended request gets."""
    from pdserve.worker.refusals import QueueFullError

    w = cluster["d"].worker
    real, refusals = w.generate, [2]

    async def full_twice(*args, **kwargs):
        if refusals[0]:
            refusals[0] -= 1
            raise QueueFullError("the worker's queue holds its maximum of 0 requests")
        return await real(*args, **kwargs)

    expected = completion(cluster["url"], prompt="hello", max_tokens=4, temperature=0, ignore_eos=True).json()
    metrics = cluster["router"].metrics
    before = metrics.requeued._value.get()
    monkeypatch.setattr(w, "generate", full_twice)
    for stream in (False, True):
        refusals[0] = 2
        r = completion(cluster["url"], prompt="hello", max_tokens=4, temperature=0, ignore_eos=True, stream=stream)
        assert r.status_code == 200 and "error" not in r.text
        if not stream:
            assert r.json()["choices"][0]["text"] == expected["choices"][0]["text"]
    assert metrics.requeued._value.get() - before == 4
    wait_for(cluster["d"].is_idle, 30, "idle decode worker")


def test_a_burst_past_the_workers_capacity_waits_in_line_in_the_router(tiny_llama):
    """The router sends a worker no more sequences than its heartbeat says it can hold (running +
    queued); the rest wait in the router, first come first served, and every request is served
    without the worker ever refusing one."""
    from pdserve.worker.refusals import QueueFullError

    with WorkerServer(tiny_llama, "decode", ["tcp"], block_size=8, max_num_seqs=2,
                      worker_args={"max_queued": 1}) as d, RouterServer(tiny_llama) as rs:
        router = rs.router
        refused, real = [], d.worker.generate

        async def counting(*args, **kwargs):
            try:
                return await real(*args, **kwargs)
            except QueueFullError:
                refused.append(1)
                raise
        d.worker.generate = counting
        rs.join(d)
        wait_for(lambda: router.registry.workers() and router.registry.workers()[0].load.capacity == 3,
                 30, "a heartbeat with the worker's capacity")
        entry = router.registry.workers()[0]
        most = [0]

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=120) as client:
                async def one(i: int) -> int:
                    r = await client.post(rs.url + "/v1/completions", json={
                        "model": MODEL, "prompt": f"request {i}", "max_tokens": 6, "ignore_eos": True,
                        "n": 1 + i % 2, "stream": i % 3 == 0})
                    most[0] = max(most[0], entry.in_flight)
                    return r.status_code if "error" not in r.text else 500
                return await asyncio.gather(*(one(i) for i in range(16)))

        statuses = asyncio.run(burst())
        assert statuses == [200] * 16
        assert not refused and most[0] <= 3
        assert entry.in_flight == 0 and not router.line and router.admission.requests == 0
        wait_for(d.is_idle, 30, "idle decode worker")


def test_a_request_still_without_room_at_its_queue_timeout_gets_503(cluster, monkeypatch):
    from pdserve.worker.refusals import QueueFullError

    async def always_full(*args, **kwargs):
        raise QueueFullError("the worker's queue holds its maximum of 0 requests")

    monkeypatch.setattr(cluster["d"].worker, "generate", always_full)
    monkeypatch.setattr(cluster["router"].config, "queue_timeout_s", 0.3)
    r = completion(cluster["url"], prompt="hello", max_tokens=4)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert cluster["router"].admission.requests == 0


def test_chat_without_max_tokens_gets_the_default_cap(cluster):
    router = cluster["router"]
    saved, router.config.max_tokens_default = router.config.max_tokens_default, 7
    try:
        r = httpx.post(cluster["url"] + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "n": 3})
    finally:
        router.config.max_tokens_default = saved
    assert r.status_code == 200
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 3
    assert r.json()["usage"]["completion_tokens"] == 3 * 7


def test_a_non_streaming_client_that_leaves_stops_its_request(cluster):
    router, d = cluster["router"], cluster["d"]
    aborted = d.worker.stats().requests_aborted
    gate = threading.Event()
    d.worker.loop.call(lambda: gate.wait(30))  # the engine waits: the request cannot finish before the client leaves
    body = json.dumps({"model": MODEL, "prompt": "a long answer", "max_tokens": 900, "ignore_eos": True}).encode()
    sock = connect(cluster["url"])
    try:
        sock.sendall(head("POST", "/v1/completions", "Content-Type: application/json",
                          f"Content-Length: {len(body)}") + body)
        wait_for(lambda: len(router.live) == 1, 30, "the request reaching the decode worker")
    finally:
        sock.close()
    wait_for(lambda: not router.live and router.admission.requests == 0, 30, "the router letting go")
    gate.set()
    wait_for(lambda: d.worker.stats().requests_aborted == aborted + 1, 30, "the worker's abort")
    wait_for(d.is_idle, 30, "idle decode worker")


class SilentWorker:
    """Answers /v1/generate with a 200 and then never another byte, like a worker whose host froze."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n")

    def close(self) -> None:
        self.listener.close()
        for c in self.conns:
            c.close()


def test_a_silent_stream_ends_alone_and_its_worker_stays(tiny_llama):
    """A stream whose worker says nothing for the silence deadline gives up on it (retried
    elsewhere, here nowhere: 503). The worker is not dropped: its other streams go on, and the
    reaper drops it only if its heartbeats stop."""
    with RouterServer(tiny_llama, worker_silence_s=0.5) as rs:
        router, silent = rs.router, SilentWorker()
        try:
            entry = router.registry.register(silent.url, "decode", router.registry.model_hash)
            bystander = LiveStream("other", 1, 4, 4, worker_id=entry.worker_id)
            router.live["other"] = bystander
            r = completion(rs.url, prompt="hello", max_tokens=4)
            assert r.status_code == 503 and "no worker" in r.json()["error"]["message"]  # retried, none left
            assert [w.worker_id for w in router.registry.workers()] == [entry.worker_id]
            assert bystander.inbox.empty()
            text = httpx.get(rs.url + "/metrics").text
            assert "pdserve_silent_streams_total 1.0" in text and "pdserve_workers_dropped_total 0.0" in text
        finally:
            router.live.pop("other", None)
            silent.close()


def test_dropping_a_worker_ends_every_stream_it_held(tiny_llama):
    router = make_router(tiny_llama)
    a = router.registry.register("http://127.0.0.1:1", "decode", router.registry.model_hash)
    b = router.registry.register("http://127.0.0.1:2", "decode", router.registry.model_hash)

    async def scenario() -> list:
        streams = [LiveStream(f"r{i}", 1, 4, 4, worker_id=w.worker_id) for i, w in enumerate((a, a, b))]
        router.live = {s.request_id: s for s in streams}
        router.drop_worker(a.worker_id, "it failed a request")
        return [s.inbox.get_nowait() if not s.inbox.empty() else None for s in streams]

    lost = asyncio.run(scenario())
    assert isinstance(lost[0], WorkerLost) and isinstance(lost[1], WorkerLost) and lost[2] is None
    assert [w.worker_id for w in router.registry.workers()] == [b.worker_id]


def test_metrics_show_each_workers_pool(cluster):
    d = cluster["d"]
    total = d.worker.stats().kv_blocks_total
    wait_for(lambda: cluster["router"].registry.workers()[0].heartbeats > 0, 30, "a heartbeat")
    text = httpx.get(cluster["url"] + "/metrics").text
    wid = cluster["router"].registry.workers()[0].worker_id
    assert f'pdserve_worker_kv_blocks_total{{role="decode",worker="{wid}"}} {float(total)}' in text
    for name in ("kv_blocks_used", "kv_usage", "running", "waiting", "heartbeat_age_seconds"):
        assert f"pdserve_worker_{name}{{" in text


def test_metrics_show_what_each_speculating_worker_drafted(cluster):
    """A worker that speculates heartbeats its drafts; the router's one scrape shows them per worker
    and method (a decode worker's draft prompt tokens: 0 where its prefill workers ship the draft's
    KV), and no draft series for a worker that does not speculate."""
    router = cluster["router"]
    entry = router.registry.register("http://127.0.0.1:3", "decode", router.registry.model_hash)
    try:
        stats = {"speculative": "draft", "draft_tokens": 40, "draft_tokens_accepted": 31, "draft_prompt_tokens": 0}
        r = httpx.post(cluster["url"] + "/internal/heartbeat", json={"worker_id": entry.worker_id, "stats": stats})
        assert r.status_code == 200, r.text
        text = httpx.get(cluster["url"] + "/metrics").text
        labels = f'method="draft",role="decode",worker="{entry.worker_id}"'
        for name, value in (("draft_tokens", 40), ("draft_tokens_accepted", 31), ("draft_prompt_tokens", 0)):
            assert f"pdserve_worker_{name}{{{labels}}} {float(value)}" in text
        assert text.count("pdserve_worker_draft_tokens{") == 1  # the cluster's own worker does not speculate
    finally:
        router.registry.remove(entry.worker_id)


@pytest.mark.parametrize("stats", [{"running": "many"}, {"kv_blocks_total": 0}, {"running": -1}, {"capacity": -1},
                                   {"capacity": 1 << 41},
                                   {"step_latency_ewma_ms": 1e300}, {"x" * 100: 1}, {"nested": {"a": 1}}])
def test_a_heartbeat_with_bad_stats_is_refused(cluster, stats):
    router = cluster["router"]
    entry = router.registry.register("http://127.0.0.1:3", "prefill", router.registry.model_hash)
    try:
        r = httpx.post(cluster["url"] + "/internal/heartbeat", json={"worker_id": entry.worker_id, "stats": stats})
        assert r.status_code == 400, r.text
        assert router.registry.get(entry.worker_id).load.running == 0
        ok = completion(cluster["url"], prompt="still served", max_tokens=2)
        assert ok.status_code == 200
    finally:
        router.registry.remove(entry.worker_id)


def test_a_client_that_stops_reading_is_dropped():
    """A streamed response whose client reads nothing gives up after `stall_s`: its generator is
    closed (what the request held is released) and the connection closed."""
    closed = threading.Event()

    async def endless():
        try:
            while True:
                yield b"x" * 65536
        finally:
            closed.set()

    app = FastAPI()

    @app.get("/stream")
    async def stream():
        return StallGuardedStreamingResponse(endless(), stall_s=0.3, media_type="text/plain")

    server = ServerThread(app).start()
    sock = connect(server.url)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(head("GET", "/stream"))
        assert closed.wait(30), "the stalled stream was not closed"
    finally:
        sock.close()
        server.stop()


@pytest.mark.parametrize("n", [1, 2])
def test_a_streamed_client_that_leaves_aborts_its_request_on_the_worker(cluster, n, monkeypatch):
    """The router tells the worker (`/v1/abort`), not only by closing its connection, which a busy
    worker in another process noticed late or never; the engine is held while the client leaves,
    so the request cannot finish first."""
    from pdserve.router import streams

    w = cluster["d"].worker
    sent, real = [], streams.abort_on_worker
    monkeypatch.setattr(streams, "abort_on_worker", lambda *a: (sent.append(a[2]), real(*a)))
    before = w.stats().requests_aborted
    gate = threading.Event()
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1000, "ignore_eos": True, "stream": True, "n": n}
    try:
        with httpx.Client(timeout=60) as client, client.stream("POST", cluster["url"] + "/v1/completions",
                                                               json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    w.loop.call(lambda: gate.wait(30))  # the request cannot run on while its client leaves
                    break
        wait_for(lambda: sent, 30, "the router's abort")
    finally:
        gate.set()
    wait_for(lambda: w.stats().requests_aborted > before, 30, "the abort on the worker")
    wait_for(cluster["d"].is_idle, 30, "idle decode worker")
    assert sent[0].endswith("-0")


@pytest.mark.parametrize("stream", [False, True])
def test_the_routers_own_no_room_refusal_is_a_503_with_retry_after(cluster, monkeypatch, stream):
    """Every decode worker holds as many sequences from this router as it said it can: the request
    waits in line, and at its queue timeout gets a 503 with Retry-After before any byte of a
    response, streamed or not; nothing it held is left behind."""
    import openai

    router = cluster["router"]
    entry = router.registry.workers()[0]
    wait_for(lambda: entry.load.capacity > 0, 30, "a heartbeat with the worker's capacity")
    monkeypatch.setattr(router.config, "queue_timeout_s", 0.3)
    monkeypatch.setattr(entry, "in_flight", entry.load.capacity)  # every sequence it can hold is taken
    r = completion(cluster["url"], prompt="hello", max_tokens=4, stream=stream)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "overloaded"
    client = openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as refused:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=4, stream=stream)
    assert refused.value.status_code == 503
    assert router.admission.requests == 0 and not router.line and entry.in_flight == entry.load.capacity


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_while_waiting_in_line_leaves_nothing_held(cluster, monkeypatch, stream):
    router = cluster["router"]
    entry = router.registry.workers()[0]
    wait_for(lambda: entry.load.capacity > 0, 30, "a heartbeat with the worker's capacity")
    monkeypatch.setattr(router.config, "queue_timeout_s", 30.0)
    monkeypatch.setattr(entry, "in_flight", entry.load.capacity)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster["url"] + "/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": stream},
                   timeout=httpx.Timeout(5, read=0.5))
    wait_for(lambda: router.admission.requests == 0 and not router.line, 10, "the router to let the request go")
    monkeypatch.setattr(entry, "in_flight", 0)  # room again: the next request is served
    assert completion(cluster["url"], prompt="hello", max_tokens=4, stream=stream).status_code == 200
    wait_for(lambda: entry.in_flight == 0 and cluster["d"].is_idle(), 30, "an idle decode worker")
