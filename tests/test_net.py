"""The HTTP listeners: Nagle off on accepted connections, dead-peer detection inherited; the servers on
them: a deadline on request heads, a cap on their size, and a concurrency limit answered 503."""

import asyncio
import contextlib
import json
import socket

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from pdserve.net import ServerLimits, tcp_listener
from pdserve.router.app import create_app as router_app
from pdserve.worker.server import ServerThread
from pdserve.worker.server import create_app as worker_app
from pdserve.worker.config import WorkerConfig
from pdserve.worker.worker import Worker
from tests.factories import engine_config
from tests.http_raw import closed_by_server, connect, head, read_response, trickle
from tests.router_server import make_router
from tests.wait import wait_for


def test_accepted_connections_detect_dead_peers():
    listener = tcp_listener("127.0.0.1", 0, dead_peer_s=12)
    client = socket.create_connection(listener.getsockname())
    conn, _ = listener.accept()
    try:
        assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 12_000
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 6
        assert listener.proto == socket.IPPROTO_TCP
    finally:
        for s in (conn, client, listener):
            s.close()


def test_a_taken_port_is_a_clear_error():
    first = tcp_listener("127.0.0.1", 0)
    try:
        with pytest.raises(OSError):
            tcp_listener("127.0.0.1", first.getsockname()[1])
    finally:
        first.close()


# -- the servers built on them: limits on what any client may hold -----------------------------


@pytest.fixture(scope="module", params=["router", "worker"])
def app(request, tiny_llama):
    """The real apps, each with a path any client may GET."""
    if request.param == "router":
        yield router_app(make_router(tiny_llama, max_model_len=64)), "/v1/models"
        return
    worker = Worker(engine_config(tiny_llama, "both"), WorkerConfig(transfer="tcp"))
    worker.start()
    yield worker_app(worker), "/stats"
    worker.stop()


@contextlib.contextmanager
def serving(app, **limits):
    http = ServerThread(app, limits=ServerLimits(**limits)).start()
    try:
        yield http
    finally:
        http.stop()


SLOW_HEAD = head("GET", "/health", "X-Padding: " + "y" * 60)


def test_a_request_head_sent_too_slowly_is_cut_off(app):
    app, path = app
    with serving(app, head_timeout_s=0.5) as http:
        with connect(http.url) as sock:
            assert trickle(sock, SLOW_HEAD, pause_s=0.1) < len(SLOW_HEAD)
            assert closed_by_server(sock)  # closed, with no answer
        with connect(http.url) as sock:  # the same on a kept-alive connection after its first response
            sock.sendall(head("GET", path))
            assert read_response(sock)[0] == 200
            assert trickle(sock, SLOW_HEAD, pause_s=0.1) < len(SLOW_HEAD)
            assert closed_by_server(sock)
        assert httpx.get(http.url + path).status_code == 200


def test_past_the_concurrency_limit_requests_get_503(app):
    app, path = app
    with serving(app, max_concurrency=2, head_timeout_s=60) as http:
        connections = http.server.server_state.connections
        idle = [connect(http.url) for _ in range(2)]
        wait_for(lambda: len(connections) == 2, 10, "both idle connections held")
        with connect(http.url) as sock:
            sock.sendall(head("GET", path))
            status, headers, body = read_response(sock)
            err = json.loads(body)["error"]
            assert status == 503 and err["type"] == "service_unavailable" and err["code"] == 503
            assert headers["retry-after"] == "1" and headers["connection"] == "close"
            assert closed_by_server(sock)
        for sock in idle:
            sock.close()
        wait_for(lambda: not connections, 10, "every connection closed")
        assert httpx.get(http.url + path).status_code == 200


def test_a_head_past_its_size_cap_is_refused(app):
    app, path = app
    with serving(app, max_head_bytes=2048) as http:
        with connect(http.url) as sock:  # a head that never ends, however slowly or quickly it comes
            sock.sendall(head("GET", path, "X-Padding: " + "y" * 4096)[:-2])
            assert read_response(sock)[0] == 400
        assert httpx.get(http.url + path, headers={"X-Padding": "y" * 1024}).status_code == 200


def test_the_head_deadline_spares_requests_in_progress():
    """A response slower than the head deadline, streamed or not, is not cut, and the connection
    serves the next request."""
    app = FastAPI()

    @app.get("/slow")
    async def slow():
        await asyncio.sleep(1.0)
        return {"ok": True}

    @app.get("/stream")
    async def stream():
        async def lines():
            for i in range(4):
                await asyncio.sleep(0.3)
                yield f"{i}\n".encode()
        return StreamingResponse(lines(), media_type="application/x-ndjson")

    with serving(app, head_timeout_s=0.3) as http, httpx.Client(base_url=http.url) as client:
        assert client.get("/slow").json() == {"ok": True}
        assert client.get("/stream").text == "0\n1\n2\n3\n"
        assert client.get("/slow").json() == {"ok": True}


def test_server_limits_are_checked():
    with pytest.raises(ValueError, match="max_concurrency"):
        ServerLimits(max_concurrency=0)
    with pytest.raises(ValueError, match="head_timeout_s"):
        ServerLimits(head_timeout_s=0)
