"""Traces from real processes: `pdserve serve --otlp-traces-endpoint` (a router, a prefill and a
decode worker, each its own process and tracer) sends its spans over OTLP/HTTP (protobuf) to a
receiver started here. One trace a request, its spans parented across the processes; the phases'
durations add up to the latency the client measured."""

from __future__ import annotations

import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra: pip install 'pdserve[otel]'")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest, ExportTraceServiceResponse)

from pdserve.credentials import TOKEN_ENV  # noqa: E402
from tests.serve_process import ServeProcess  # noqa: E402
from tests.wait import wait_for  # noqa: E402
from tests.worker.cluster import prompt  # noqa: E402


class Receiver:
    """An OTLP/HTTP traces endpoint on 127.0.0.1: every span it is sent, flattened."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        received = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the standard library's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                ok = self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf"
                if ok:
                    export = ExportTraceServiceRequest.FromString(body)
                    for resource_spans in export.resource_spans:
                        resource = {a.key: a.value for a in resource_spans.resource.attributes}
                        for scope in resource_spans.scope_spans:
                            for span in scope.spans:
                                received.append({
                                    "service": resource["service.name"].string_value,
                                    "pid": resource["process.pid"].int_value, "name": span.name,
                                    "trace": span.trace_id.hex(), "id": span.span_id.hex(),
                                    "parent": span.parent_span_id.hex(), "seconds":
                                        (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9,
                                    "attributes": {a.key: a.value for a in span.attributes}})
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str) -> list[dict]:
        return [s for s in self.spans if s["trace"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_spans_of_three_processes_make_one_trace_a_request(tiny_llama):
    receiver = Receiver()
    cluster = ServeProcess("--model", str(tiny_llama), "--port", "0", "--prefill", "1", "--decode", "1",
                           "--dtype", "float32", "--block-size", "4", "--kv-cache-memory", "8MiB",
                           "--otlp-traces-endpoint", receiver.url, env={**os.environ, TOKEN_ENV: "t" * 48})
    try:
        wait_for(lambda: cluster.event("ready") or cluster.proc.poll() is not None, 240, "the cluster",
                 state=lambda: cluster.log[-5:])
        ready = cluster.event("ready")
        assert ready is not None, cluster.log[-20:]
        client = openai.OpenAI(base_url=ready["url"] + "/v1", api_key="none", max_retries=0, timeout=60)
        observed = {}
        for n in range(3):
            trace_id = f"{n + 1:032x}"
            started = time.monotonic()
            client.completions.create(model=ready["model"], prompt=prompt(300 + n, seed=n), max_tokens=10,
                                      extra_body={"ignore_eos": True},  # past 256 tokens: prefilled remotely
                                      extra_headers={"traceparent": f"00-{trace_id}-{n + 1:016x}-01"})
            observed[trace_id] = time.monotonic() - started
        # each process sends its batch within its schedule delay (5 s)
        wait_for(lambda: all(len(receiver.trace(t)) >= 10 for t in observed), 30, "every trace's spans",
                 state=lambda: {t: len(receiver.trace(t)) for t in observed})
        for trace_id, seconds in observed.items():
            spans = receiver.trace(trace_id)
            by_name = {s["name"]: s for s in spans}
            root = next(s for s in spans if s["service"] == "pdserve-router" and s["name"].startswith("text_"))
            decode, prefill = by_name["pdserve.decode"], by_name["pdserve.prefill"]
            assert root["parent"] == trace_id[-16:]  # the client's span
            assert decode["parent"] == root["id"] and prefill["parent"] == decode["id"]
            assert len({root["pid"], decode["pid"], prefill["pid"]}) == 3  # three processes
            assert {s["service"] for s in spans} == {"pdserve-router", "pdserve-worker"}
            assert len([s for s in spans if s["name"] == root["name"]]) == 1  # one request, one trace
            phases = sum(s["seconds"] for s in spans if "pdserve.phase" in s["attributes"])
            assert abs(phases - seconds) <= 0.1 * seconds + 0.05, (phases, seconds)
            assert prefill["attributes"]["pdserve.request_id"].string_value.startswith(
                decode["attributes"]["pdserve.request_id"].string_value)
    finally:
        cluster.close()
        receiver.close()
