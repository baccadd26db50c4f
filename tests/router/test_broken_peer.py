"""A decode worker that takes a request (200, a first line of tokens) and then fails: its
connection drops mid-stream, or it sends a line that is not an output. The client gets its first
token and then a clean terminal error (no internal address or detail), the router tells the
worker to abort the request, and holds nothing of the request afterwards."""

from __future__ import annotations

import json
import socket
import socketserver
import threading

import httpx
import pytest

from pdserve import wire
from tests.router_server import MODEL, RouterServer
from tests.wait import wait_for


class BrokenPeer:
    """A /v1/generate endpoint on 127.0.0.1 that answers 200 and one output line of `FIRST_TOKEN`,
    then `how`: "dies" (the connection closes without ending the chunked body) or "garbage" (a
    line that is neither an output nor an error). /v1/abort is answered and recorded."""

    FIRST_TOKEN = 5

    def __init__(self, how: str) -> None:
        self.how = how
        self.generates: list[dict] = []
        self.aborts: list[str] = []
        peer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                request_line = self.rfile.readline().decode()
                headers = {}
                while (line := self.rfile.readline().decode().strip()):
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = json.loads(self.rfile.read(int(headers.get("content-length", 0))) or b"{}")
                path = request_line.split()[1]
                if path == "/v1/abort":
                    peer.aborts.append(body["request_id"])
                    reply = json.dumps({"request_id": body["request_id"]}).encode()
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                                     b"Content-Length: %d\r\n\r\n%s" % (len(reply), reply))
                    return
                peer.generates.append(body)
                self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n")
                first = wire.encode(wire.OutputLine(
                    request_id=body["request_id"], num_prompt_tokens=len(body["prompt_token_ids"]),
                    outputs=[wire.CompletionDelta(index=0, token_ids=[peer.FIRST_TOKEN])])) + b"\n"
                self.wfile.write(chunk(first))
                if peer.how == "garbage":
                    self.wfile.write(chunk(b"<html>502 Bad Gateway</html>\n") + b"0\r\n\r\n")
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)  # "dies": the body never ends

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True)

    def __enter__(self) -> BrokenPeer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def sse(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("how", ["dies", "garbage"])
def test_a_worker_that_fails_after_taking_a_request(tiny_llama, how):
    with BrokenPeer(how) as peer, RouterServer(tiny_llama, lease_s=60.0) as rs:
        router = rs.router
        entry = router.registry.register(peer.url, "decode", router.registry.model_hash)
        router.registry.heartbeat(entry.worker_id, wire.WorkerStats(role="decode", kv_blocks_total=100))

        chunks = sse(rs.url, {"model": MODEL, "prompt": "hello there", "max_tokens": 8, "temperature": 0,
                              "stream": True})

        assert len(peer.generates) == 1  # taken once: a request that has begun is not sent again
        texts = [c["choices"][0]["text"] for c in chunks if "choices" in c and c["choices"]]
        assert "".join(texts) == router.tokenizer.decode([BrokenPeer.FIRST_TOKEN])
        assert chunks[-1] == {"error": {"message": "the decode worker failed mid-request", "type": "server_error",
                                        "param": None, "code": 502}}
        assert peer.url not in json.dumps(chunks)  # nothing internal reaches the client
        # the worker is told to abort the request (sent after the stream ended: wait for it)
        wait_for(lambda: peer.aborts == [peer.generates[0]["request_id"]], 30, "the abort to reach the worker",
                 state=lambda: peer.aborts)
        assert router.live == {} and len(router.line) == 0
        assert (router.admission.requests, router.admission.tokens) == (0, 0)
        assert entry.in_flight == 0
        # dropped at its failure, not when its lease (60 s) lapses; a live worker registers again
        assert router.registry.get(entry.worker_id) is None
