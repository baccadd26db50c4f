"""Traces of requests across the router, a prefill and a decode worker, in this process: each
component's own tracer (as each process has one), their spans collected by the SDK's in-memory
exporter. One trace a request, honouring the client's `traceparent`; the decode worker's span a
child of the router's, the prefill worker's a child of the decode worker's; the phases tile the
request: their durations add up to what the client measured."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra: pip install 'pdserve[otel]'")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

from pdserve import wire  # noqa: E402
from pdserve.router.policy import DisaggregationPolicy  # noqa: E402
from pdserve.telemetry.tracing import Tracer, traces_url, valid_traceparent, wall_ns  # noqa: E402
from tests.router_server import MODEL, RouterServer  # noqa: E402
from tests.wait import wait_for  # noqa: E402
from tests.worker.cluster import WorkerServer, prompt  # noqa: E402

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


def test_trace_contexts_and_endpoints():
    assert valid_traceparent(CLIENT_PARENT) == CLIENT_PARENT
    assert valid_traceparent(" " + CLIENT_PARENT.upper()) == CLIENT_PARENT
    for bad in ("", None, "01-" + CLIENT_PARENT[3:], f"00-{'0' * 32}-00f067aa0ba902b7-01", CLIENT_PARENT + "-x",
                f"00-{CLIENT_TRACE}-{'0' * 16}-01", "00-" + "g" * 32 + "-00f067aa0ba902b7-01"):
        assert valid_traceparent(bad) == ""
    assert traces_url("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert traces_url("https://c:4318/custom/path") == "https://c:4318/custom/path"
    with pytest.raises(ValueError, match="http"):
        traces_url("grpc://c:4317")
    assert wall_ns(10.0, now_mono=12.5, now_ns=10_000_000_000) == 7_500_000_000


def test_a_malformed_traceparent_on_the_wire_is_refused_naming_its_field():
    body = {"prompt_token_ids": [1, 2], "traceparent": "00-nothex-01"}
    with pytest.raises(wire.BadMessage, match="traceparent"):
        wire.decode(json.dumps(body), wire.GenerateRequest)
    with pytest.raises(wire.BadMessage, match="traceparent"):
        wire.decode(json.dumps({**body, "traceparent": CLIENT_PARENT + "0" * 400}), wire.GenerateRequest)
    assert wire.decode(json.dumps({**body, "traceparent": CLIENT_PARENT}), wire.GenerateRequest).traceparent


def test_tracing_off_costs_no_import_of_the_sdk():
    code = ("import sys; import pdserve.router.app, pdserve.worker.worker, pdserve.cli; "
            "assert not [m for m in sys.modules if m.startswith('opentelemetry.sdk')]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.fixture(scope="module")
def traced(tiny_llama):
    exporter = InMemorySpanExporter()
    tracers = [Tracer(service, exporter=exporter) for service in ("pdserve-router", "prefill", "decode")]
    p = WorkerServer(tiny_llama, "prefill", ["tcp"], tracer=tracers[1])
    d = WorkerServer(tiny_llama, "decode", ["tcp"], tracer=tracers[2], block_size=8)
    try:
        with RouterServer(tiny_llama, disaggregation=DisaggregationPolicy(min_remote_tokens=64)) as rs:
            rs.router.tracer = tracers[0]
            rs.join(p)
            rs.join(d)
            yield rs, p, d, exporter
    finally:
        p.stop()
        d.stop()


def spans_of(exporter, trace_id: int, count: int) -> list:
    wait_for(lambda: sum(s.context.trace_id == trace_id for s in exporter.get_finished_spans()) >= count, 10,
             f"{count} spans of the trace", state=lambda: [(s.name, s.resource.attributes["service.name"],
                                                            s.context.trace_id == trace_id)
                                                           for s in exporter.get_finished_spans()])
    return [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]


def request_trace(exporter, client_trace: int | None = None):
    """The trace of the newest request (the router's server span that ended last)."""
    roots = [s for s in exporter.get_finished_spans() if s.resource.attributes["service.name"] == "pdserve-router"
             and s.kind == SpanKind.SERVER]
    root = roots[-1]
    if client_trace is not None:
        assert root.context.trace_id == client_trace
    return root


def test_a_disaggregated_request_is_one_trace_across_the_three_and_its_phases_add_up(traced):
    rs, p, d, exporter = traced
    exporter.clear()
    client = openai.OpenAI(base_url=rs.url + "/v1", api_key="none", max_retries=0, timeout=60)
    tokens = prompt(200, seed=3)
    started = time.monotonic()
    r = client.completions.create(model=MODEL, prompt=tokens, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True}, extra_headers={"traceparent": CLIENT_PARENT})
    observed = time.monotonic() - started
    root = request_trace(exporter, int(CLIENT_TRACE, 16))
    spans = spans_of(exporter, root.context.trace_id, 10)
    assert root.parent.span_id == int("00f067aa0ba902b7", 16)  # the client's span is its parent
    by_name = {s.name: s for s in spans}
    decode, prefill = by_name["pdserve.decode"], by_name["pdserve.prefill"]
    assert decode.parent.span_id == root.context.span_id and decode.kind == SpanKind.SERVER
    assert prefill.parent.span_id == decode.context.span_id
    assert decode.resource.attributes["service.name"] == "decode"
    assert prefill.resource.attributes["service.name"] == "prefill"
    for name, parent in (("router.queue", root), ("decode.queue", decode), ("decode.kv_wait", decode),
                         ("decode.generate", decode), ("prefill.queue", prefill), ("prefill.compute", prefill),
                         ("prefill.kv_send", prefill)):
        assert by_name[name].parent.span_id == parent.context.span_id, name
    assert "decode.prefill" not in by_name  # the prompt was computed on the prefill worker

    assert root.attributes["gen_ai.usage.input_tokens"] == r.usage.prompt_tokens == 200
    assert root.attributes["gen_ai.usage.output_tokens"] == r.usage.completion_tokens == 12
    assert root.attributes["pdserve.route.disaggregated"] and root.attributes["pdserve.outcome"] == "ok"
    assert [e.name for e in root.events] == ["first_token"]
    send = by_name["prefill.kv_send"].attributes
    layout = d.worker.layout
    assert send["pdserve.kv.backend"] == "tcp"
    assert send["pdserve.kv.bytes"] == 200 * layout.slot_bytes * layout.num_layers
    assert by_name["prefill.compute"].events and all(e.name == "chunk" for e in by_name["prefill.compute"].events)
    assert decode.attributes["gen_ai.usage.output_tokens"] == 12 and decode.attributes["pdserve.prefilled_remotely"]

    phases = [s for s in spans if "pdserve.phase" in s.attributes]
    assert {s.attributes["pdserve.phase"] for s in phases} == {"router_queue", "queue", "prefill", "transfer", "decode"}
    total = sum(s.end_time - s.start_time for s in phases) / 1e9
    # the phases tile the request: what they miss is HTTP between the processes and the router's own work
    assert abs(total - observed) <= 0.1 * observed + 0.05, (total, observed)
    assert (root.end_time - root.start_time) / 1e9 <= observed
    assert wait_for(lambda: p.is_idle() and d.is_idle(), 10, "both workers idle") is None


def test_a_request_prefilled_where_it_decodes_and_one_without_a_client_trace(traced):
    rs, p, d, exporter = traced
    exporter.clear()
    r = httpx.post(rs.url + "/v1/completions", json={"model": MODEL, "prompt": prompt(20), "max_tokens": 5,
                                                     "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    root = request_trace(exporter)
    assert root.parent is None  # a new trace
    spans = spans_of(exporter, root.context.trace_id, 6)
    names = {s.name for s in spans}
    assert {"router.queue", "pdserve.decode", "decode.queue", "decode.prefill", "decode.generate"} <= names
    assert not names & {"pdserve.prefill", "decode.kv_wait"}
    assert not root.attributes["pdserve.route.disaggregated"]
    assert wait_for(lambda: p.is_idle() and d.is_idle(), 10, "both workers idle") is None


def test_a_refused_request_ends_its_span_as_an_error(traced):
    rs, _, _, exporter = traced
    exporter.clear()
    too_long = rs.router.config.max_model_len  # with the prompt, past the model's context
    r = httpx.post(rs.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": too_long},
                   headers={"traceparent": CLIENT_PARENT}, timeout=30)
    assert r.status_code == 400, r.text
    root = request_trace(exporter, int(CLIENT_TRACE, 16))
    assert root.attributes["pdserve.outcome"] == "error" and not root.status.is_ok
