"""Traces of requests, in OpenTelemetry, sent over OTLP/HTTP (protobuf) to a collector.

Off by default, and then free: nothing of OpenTelemetry is imported, and every process holds
`None` where a tracer would be. `--otlp-traces-endpoint URL` on `pdserve serve`, `router` and
`worker` turns it on (the optional `otel` extra: `pip install 'pdserve[otel]'`); a URL without a
path gets the collector's `/v1/traces`. The exporter's own environment variables apply
(`OTEL_EXPORTER_OTLP_TRACES_HEADERS` for a collector's key: never a command line).

A trace crosses processes as a W3C `traceparent` (`00-<trace id>-<span id>-<flags>`): the
client's header at the router, `GenerateRequest.traceparent` to the decode worker,
`PrefillLease.traceparent` to the prefill worker. The engine keeps its requests' times anyway
(`time.monotonic()`), so each process makes its phase spans from them when a request ends, with
the times converted to the wall clock: nothing is traced on the engine's step path but a
step count and, while a prompt computes, one event per chunk.
"""

from __future__ import annotations

import os
import re
import time
from typing import Iterable
from urllib.parse import urlsplit

TRACEPARENT = re.compile(r"^00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}\Z")
TRACEPARENT_MAX = 55
# Each span's `pdserve.phase`: the spans that carry one tile a request's time, across processes
PHASES = ("router_queue", "queue", "prefill", "transfer", "decode")


def valid_traceparent(value: str | None) -> str:
    """The header as sent if it is a version-00 W3C traceparent (ids not all zero), else ""."""
    value = (value or "").strip().lower()
    return value if len(value) <= TRACEPARENT_MAX and TRACEPARENT.match(value) else ""


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector's address (`http://host:4318` -> `.../v1/traces`)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--otlp-traces-endpoint must be an http(s) URL, got {endpoint!r}")
    return endpoint if parts.path.strip("/") else endpoint.rstrip("/") + "/v1/traces"


def otlp_endpoint(text: str) -> str:
    """The `--otlp-traces-endpoint` flag: an http(s) URL (checked; kept as given), or "" (off)."""
    if text:
        traces_url(text)
    return text


def wall_ns(monotonic_s: float, now_mono: float | None = None, now_ns: int | None = None) -> int:
    """A `time.monotonic()` instant on the wall clock, in nanoseconds since the epoch."""
    now_mono = time.monotonic() if now_mono is None else now_mono
    now_ns = time.time_ns() if now_ns is None else now_ns
    return now_ns - int((now_mono - monotonic_s) * 1e9)


class Tracer:
    """One process's tracer: spans begun and ended at given instants (monotonic seconds), their
    parents given as traceparents or spans. `exporter`: where spans go (tests pass the SDK's
    in-memory exporter; by default OTLP/HTTP to `endpoint`, batched off the caller's thread)."""

    def __init__(self, service: str, endpoint: str = "", exporter=None, attributes: dict | None = None) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise RuntimeError("tracing needs the otel extra: pip install 'pdserve[otel]'") from e
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter, processor = OTLPSpanExporter(endpoint=traces_url(endpoint)), BatchSpanProcessor
        else:
            processor = SimpleSpanProcessor
        self.provider = TracerProvider(resource=Resource.create({"service.name": service, "process.pid": os.getpid(),
                                                                 **(attributes or {})}))
        self.provider.add_span_processor(processor(exporter))
        self._tracer = self.provider.get_tracer("pdserve")
        self._propagator = TraceContextTextMapPropagator()

    def begin(self, name: str, start_s: float, parent: str | object | None = None, attributes: dict | None = None,
              server: bool = False, links: Iterable[str] = ()):
        """A span from `start_s`: a child of `parent` (a traceparent, or a span), or a new trace."""
        from opentelemetry import trace

        context = self._context(parent)
        kind = trace.SpanKind.SERVER if server else trace.SpanKind.INTERNAL
        linked = [trace.Link(ctx) for tp in links
                  if (ctx := trace.get_current_span(self._context(tp)).get_span_context()).is_valid]
        return self._tracer.start_span(name, context=context, kind=kind, attributes=attributes or {},
                                       start_time=wall_ns(start_s), links=linked)

    def phase(self, parent, name: str, start_s: float, end_s: float, phase: str | None = None,
              attributes: dict | None = None, events: Iterable[tuple[str, float, dict]] = ()) -> None:
        """A finished child span of `parent` from `start_s` to `end_s`; `phase`: one of PHASES."""
        span = self.begin(name, start_s, parent, {**(attributes or {}), **({"pdserve.phase": phase} if phase else {})})
        for event, at, event_attributes in events:
            span.add_event(event, event_attributes, timestamp=wall_ns(at))
        span.end(end_time=wall_ns(max(start_s, end_s)))

    @staticmethod
    def end(span, end_s: float, attributes: dict | None = None, error: str = "") -> None:
        from opentelemetry.trace import Status, StatusCode

        if attributes:
            span.set_attributes(attributes)
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=wall_ns(end_s))

    @staticmethod
    def event(span, name: str, at_s: float, attributes: dict | None = None) -> None:
        span.add_event(name, attributes or {}, timestamp=wall_ns(at_s))

    def traceparent(self, span) -> str:
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, trace.set_span_in_context(span))
        return carrier.get("traceparent", "")

    def _context(self, parent):
        from opentelemetry import trace

        if parent is None or parent == "":
            return None
        if isinstance(parent, str):
            return self._propagator.extract({"traceparent": parent})
        return trace.set_span_in_context(parent)

    def close(self) -> None:
        """Send what is still batched, then stop."""
        self.provider.shutdown()


def tracer_for(endpoint: str, service: str, attributes: dict | None = None) -> Tracer | None:
    """The process's tracer, or None where no endpoint is set (tracing off)."""
    return Tracer(service, endpoint, attributes=attributes) if endpoint else None
