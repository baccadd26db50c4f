"""`pdserve bench-router`: its percentiles, its capacity run (exactly the requests asked for, over
the clients asked for) and its overload run (every client's answer counted by status), against a
counting HTTP endpoint in this process; and the whole command on the tiny model (slow)."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdserve.bench.router import _capacity, _overload, _percentile, main


def test_percentiles_are_the_value_at_that_rank():
    values = [float(v) for v in range(100, 0, -1)]  # 1 .. 100, unordered
    assert _percentile(values, 0.5) == 51.0  # rank int(0.5 * 100) = 50 of 0 .. 99
    assert _percentile(values, 0.99) == 100.0
    assert _percentile(values, 0.0) == 1.0
    assert _percentile([7.0], 0.99) == 7.0  # never past the last


class Endpoint:
    """POSTs answered with `statuses[i % len]` for the i-th request; bodies and clients counted."""

    def __init__(self, statuses: list[int]) -> None:
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out as two writes: no wait between

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with endpoint.lock:
                    status = statuses[len(endpoint.bodies) % len(statuses)]
                    endpoint.bodies.append(body)
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/completions"
        threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True).start()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_capacity_sends_exactly_the_requests_asked_for():
    with Endpoint([200]) as endpoint:
        rps = _capacity(endpoint.url, {"n": 1}, concurrency=4, total=25, headers={})
    assert len(endpoint.bodies) == 25 and all(b == {"n": 1} for b in endpoint.bodies)
    assert rps > 0


def test_overload_counts_every_answer_by_status():
    with Endpoint([200, 429, 429]) as endpoint:
        result = _overload(endpoint.url, {"max_tokens": 32}, clients=6, router_pid=os.getpid())
    assert len(endpoint.bodies) == 6
    assert result["clients"] == 6 and result["answers"] == {"200": 2, "429": 4}
    assert 0 < result["memory_mib_at_rest"] <= result["memory_mib_peak"]


def test_overload_counts_a_client_that_got_no_answer_by_its_error():
    with Endpoint([200]) as endpoint:
        url = endpoint.url
    result = _overload(url, {}, clients=3, router_pid=os.getpid())  # nothing listens any more
    assert result["answers"] == {"ConnectError": 3}


@pytest.mark.slow
def test_the_command_on_the_tiny_model(tmp_path, capsys):
    out = tmp_path / "router.json"
    assert main(["--requests", "4", "--concurrency", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["requests"] == 4 and result["concurrency"] == 2
    for path in ("direct", "router"):
        lat = result["latency_ms"][path]
        assert 0 < lat["p50"] <= lat["p99"] and result["capacity_rps"][path] > 0
    assert result["added_ms"]["p50"] == pytest.approx(result["latency_ms"]["router"]["p50"]
                                                      - result["latency_ms"]["direct"]["p50"])
    overload = result["overload"]
    assert overload["clients"] == 40 and sum(overload["answers"].values()) == 40
    assert set(overload["answers"]) <= {"200", "429"} and overload["answers"].get("200", 0) >= 2
    table = capsys.readouterr().out
    assert "| direct |" in table and "| router |" in table and "overload: 40 clients" in table
