"""The gate in front of the router and the workers: secrets before bodies, bodies counted as they
arrive and bounded in size and time, and the app still told when its client goes away."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from fastapi import FastAPI, Request

from pdserve.http_guard import BearerRule, BodyLimits, HTTPGuard
from pdserve.net import ServerLimits
from pdserve.worker.server import ServerThread
from pdserve.worker.server import create_app as worker_app
from pdserve.worker.config import WorkerConfig
from pdserve.worker.worker import Worker
from tests.factories import engine_config
from tests.http_raw import closed_by_server, connect, head, read_response, trickle
from tests.router_server import RouterServer

LIMIT = 4096
SLOW_BODY = BodyLimits(max_bytes=LIMIT, timeout_s=1.0, chunk_timeout_s=0.5)
KEY, TOKEN = "sk-test", "worker-secret"


@pytest.fixture(scope="module")
def router(tiny_llama):
    with RouterServer(tiny_llama, max_model_len=64, api_key=KEY, worker_token=TOKEN, max_body_bytes=LIMIT) as rs:
        yield rs.url


@pytest.fixture(scope="module")
def worker(tiny_llama):
    w = Worker(engine_config(tiny_llama, "both"), WorkerConfig(transfer="tcp"), TOKEN)
    w.start()
    http = ServerThread(worker_app(w, TOKEN, body_limits=SLOW_BODY)).start()
    yield http.url
    http.stop()
    w.stop()


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}


def assert_error(status: int, body: bytes, code: int, fragment: str) -> dict:
    err = json.loads(body)["error"]
    assert status == code and set(err) == {"message", "type", "param", "code"} and err["code"] == code
    assert fragment in err["message"], err
    return err


def still_serves(router: str | None = None, worker: str | None = None) -> None:
    if router is not None:
        assert httpx.get(router + "/v1/models", headers=bearer(KEY)).json()["data"][0]["id"] == "tiny"
    if worker is not None:
        r = httpx.post(worker + "/v1/abort", json={"request_id": "nobody"}, headers=bearer(TOKEN))
        assert r.status_code == 200 and r.json()["aborted"] is True


def chunks(total: int, size: int = 1000):
    for _ in range(total // size):
        yield b"x" * size


# -- size -------------------------------------------------------------------------------------


def test_a_chunked_body_past_the_limit_is_refused(router, worker):
    for url, path, secret in ((router, "/v1/completions", KEY), (worker, "/v1/generate", TOKEN)):
        r = httpx.post(url + path, content=chunks(3 * LIMIT), headers=bearer(secret))  # no Content-Length
        assert r.request.headers["transfer-encoding"] == "chunked"
        assert_error(r.status_code, r.content, 413, f"exceeds {LIMIT} bytes")
    still_serves(router, worker)


def test_a_declared_length_past_the_limit_is_refused_before_the_body(router, worker):
    for url, path, secret in ((router, "/v1/completions", KEY), (worker, "/v1/generate", TOKEN)):
        with connect(url) as sock:
            sock.sendall(head("POST", path, f"Authorization: Bearer {secret}", "Content-Length: 1000000000"))
            assert_error(*read_response(sock)[::2], 413, "exceeds")  # not one body byte was sent
    still_serves(router, worker)


def test_a_body_within_the_limit_reaches_the_handler_whole(router, worker):
    body = json.dumps({"model": "tiny", "prompt": "hello there", "max_tokens": 2}).encode()
    r = httpx.post(router + "/v1/completions", content=iter([body[:5], body[5:]]), headers=bearer(KEY))
    # parsed and validated: only the absence of workers stops it
    assert_error(r.status_code, r.content, 503, "no worker")
    gen = json.dumps({"prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 2, "ignore_eos": True},
                      "stream": False}).encode()
    r = httpx.post(worker + "/v1/generate", content=iter([gen[:7], gen[7:]]), headers=bearer(TOKEN))
    assert r.status_code == 200 and sum(len(line["outputs"][0]["token_ids"]) for line in r.json()) == 2


def test_content_length_with_transfer_encoding_is_refused(router, worker):
    for url, path, secret in ((router, "/v1/completions", KEY), (worker, "/v1/generate", TOKEN)):
        with connect(url) as sock:  # a small length in front of a chunked body (request smuggling)
            sock.sendall(head("POST", path, f"Authorization: Bearer {secret}", "Content-Length: 1",
                              "Transfer-Encoding: chunked") + b"5\r\nhello\r\n0\r\n\r\n")
            status, headers, body = read_response(sock)
            assert_error(status, body, 400, "not both")
            assert headers["connection"] == "close" and closed_by_server(sock)
    still_serves(router, worker)


def test_the_bytes_that_arrive_count_whatever_the_length_said():
    """A protocol that framed the body by itself (not by Content-Length) still meets the limit."""
    sent, called = [], []

    async def app(scope, receive, send):
        called.append(scope)

    async def receive():
        return {"type": "http.request", "body": b"x" * 3000, "more_body": True}

    async def send(message):
        sent.append(message)

    guard = HTTPGuard(app, BodyLimits(max_bytes=LIMIT), [])
    scope = {"type": "http", "method": "POST", "path": "/v1/x", "headers": [(b"content-length", b"10")]}
    asyncio.run(guard(scope, receive, send))
    assert not called and sent[0]["status"] == 413
    assert_error(413, sent[1]["body"], 413, f"exceeds {LIMIT} bytes")


# -- secrets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path, what", [("/v1/completions", "API key"), ("/internal/register", "worker token")])
def test_a_wrong_router_secret_is_refused_without_waiting_for_the_body(router, path, what):
    with connect(router) as sock:
        sock.sendall(head("POST", path, "Authorization: Bearer wrong", "Content-Length: 1000000000"))
        err = assert_error(*read_response(sock)[::2], 401, what)
        assert err["type"] == "authentication_error"
    still_serves(router)


def test_a_client_that_sends_its_body_anyway_still_reads_the_refusal(router, worker):
    # the server drains what it will not read, so the client's write does not meet a reset
    r = httpx.post(router + "/v1/completions", content=b"x" * (4 << 20), headers=bearer("wrong"))
    assert_error(r.status_code, r.content, 401, "API key")
    r = httpx.post(worker + "/v1/generate", content=b"x" * (4 << 20), headers=bearer(TOKEN))
    assert_error(r.status_code, r.content, 413, "exceeds")
    still_serves(router, worker)


def test_a_wrong_worker_token_is_refused_without_waiting_for_the_body(worker):
    with connect(worker) as sock:
        sock.sendall(head("POST", "/v1/generate", "Content-Length: 1000000000"))  # no token at all
        assert_error(*read_response(sock)[::2], 401, "bearer token")
    assert httpx.get(worker + "/health").json()["status"] == "ok"  # health stays open
    assert httpx.get(worker + "/stats").status_code == 401
    assert httpx.get(worker + "/stats", headers=bearer(TOKEN)).status_code == 200


def test_router_paths_outside_the_api_stay_open(router):
    assert httpx.get(router + "/health").status_code == 200
    assert httpx.get(router + "/v1/models").status_code == 401


# -- time -------------------------------------------------------------------------------------


def test_a_stalled_body_gets_408(worker):
    with connect(worker) as sock:
        sock.sendall(head("POST", "/v1/generate", f"Authorization: Bearer {TOKEN}", "Content-Length: 100") + b"{")
        status, headers, body = read_response(sock)  # and nothing more comes
        assert_error(status, body, 408, "did not arrive in time")
        assert headers["connection"] == "close" and closed_by_server(sock)
    still_serves(worker=worker)


def test_a_trickled_body_gets_408(worker):
    with connect(worker) as sock:  # every byte within the gap allowed, the whole far past its deadline
        sock.sendall(head("POST", "/v1/generate", f"Authorization: Bearer {TOKEN}", "Content-Length: 100"))
        sent = trickle(sock, b"x" * 100, pause_s=0.1)
        assert sent < 100
        assert_error(*read_response(sock)[::2], 408, "did not arrive in time")
    still_serves(worker=worker)


# -- what the app still sees ------------------------------------------------------------------


def test_the_app_learns_that_its_client_went_away():
    gone = threading.Event()
    app = FastAPI()
    app.add_middleware(HTTPGuard, limits=BodyLimits(), rules=[])

    @app.post("/wait")
    async def wait(request: Request):
        assert await request.body() == b"hello"  # replayed by the guard
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone.set()
        return {}

    http = ServerThread(app).start()
    try:
        with connect(http.url) as sock:
            sock.sendall(head("POST", "/wait", "Content-Length: 5") + b"hello")
        assert gone.wait(10)
    finally:
        http.stop()


def test_limits_are_checked():
    with pytest.raises(ValueError, match="timeouts"):
        BodyLimits(timeout_s=0)
    assert BearerRule("/v1", "k").covers("/v1/models") and not BearerRule("/v1", "k").covers("/v10")
    assert BearerRule("/", "k").covers("/anything") and ServerLimits().max_concurrency > 0
