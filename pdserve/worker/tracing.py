"""A worker's spans of its requests (with `--otlp-traces-endpoint`; pdserve/telemetry/tracing.py).

Each request the worker takes gets a span, begun when it arrived and a child of the span its
sender named (the router's for a request to generate, the decode worker's for a lease to
prefill), and when it ends, its phases as child spans, from the times the engine kept:

- a request to generate (`pdserve.decode` on a decode worker, `pdserve.generate` on a colocated
  one): `decode.queue`; then, where a prefill worker sent its prompt's KV, `decode.kv_wait` for
  what of the wait for it was neither that worker's queue nor its compute (the transfer its
  compute did not hide), or `decode.prefill` where it computed the prompt itself (after a
  failed transfer too: a `kv.fallback` event says why); then `decode.generate`, from the first
  token (an event) to the last.
- a lease (`pdserve.prefill`): `prefill.queue`, `prefill.compute` (an event per chunk), and
  `prefill.kv_send` (from the first layer written to the notification: backend, bytes), which
  overlaps the compute it hides behind.

Engine thread only (each call comes from there), so it holds no lock. Tracing never fails what
it traces: an error in it is logged (the first, then every thousandth) and the span dropped.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

from pdserve.engine.request import Request
from pdserve.engine.role import RoleHooks
from pdserve.engine.step import SchedulerOutput
from pdserve.telemetry.tracing import Tracer


log = logging.getLogger("pdserve.worker.tracing")


def _guarded(method):
    @functools.wraps(method)
    def call(self, *args):
        try:
            return method(self, *args)
        except Exception:
            self.failures += 1
            if self.failures == 1 or self.failures % 1000 == 0:
                log.exception("tracing failed (%d times so far); the requests go on untraced", self.failures)
            return None
    return call


@dataclass(slots=True)
class _Traced:
    span: object
    lease: bool  # a prefill worker's lease, not a request to generate
    attributes: dict
    steps: int = 0
    chunks: list[tuple[str, float, dict]] = field(default_factory=list)  # a prompt's: ("chunk", when, what)


class WorkerTracing(RoleHooks):
    def __init__(self, tracer: Tracer, role: str) -> None:
        self.tracer, self.role = tracer, role
        self.traced: dict[str, _Traced] = {}  # engine request id -> its span and what it gathers
        self.failures = 0

    @_guarded
    def begin_request(self, request_id: str, traceparent: str, received: float, prompt_tokens: int,
                      remote: bool) -> None:
        name = "pdserve.decode" if self.role == "decode" else "pdserve.generate"
        span = self.tracer.begin(name, received, traceparent, {"pdserve.request_id": request_id,
                                                                "pdserve.worker.role": self.role}, server=True)
        self.traced[request_id] = _Traced(span, False, {"gen_ai.usage.input_tokens": prompt_tokens,
                                                        "pdserve.prefilled_remotely": remote})

    @_guarded
    def begin_lease(self, engine_id: str, traceparent: str, received: float, backend: str, positions: int,
                    position_bytes: int) -> None:
        span = self.tracer.begin("pdserve.prefill", received, traceparent, {"pdserve.request_id": engine_id},
                                 server=True)
        self.traced[engine_id] = _Traced(span, True, {"pdserve.kv.backend": backend,
                                                      "pdserve.kv.bytes": positions * position_bytes})

    def traceparent(self, request_id: str) -> str:
        """The context a request's lease carries to its prefill worker ("" when not traced)."""
        traced = self.traced.get(request_id)
        return (self._context(traced) or "") if traced is not None else ""

    @_guarded
    def _context(self, traced: _Traced) -> str:
        return self.tracer.traceparent(traced.span)

    @_guarded
    def fallback(self, request_id: str, reason: str) -> None:
        traced = self.traced.get(request_id)
        if traced is not None:
            self.tracer.event(traced.span, "kv.fallback", time.monotonic(), {"reason": reason[:200]})

    @_guarded
    def before_execute(self, step: SchedulerOutput):
        now = time.monotonic()
        for req, n in zip(step.requests, step.num_new_tokens):
            traced = self.traced.get(req.request_id)
            if traced is None:
                continue
            traced.steps += 1
            if req.num_computed_tokens < req.num_prompt_tokens:
                traced.chunks.append(("chunk", now, {"tokens": n, "start": req.num_computed_tokens}))
        return None

    @_guarded
    def on_finished(self, request: Request) -> None:
        traced = self.traced.pop(request.request_id, None)
        if traced is None:
            return
        # a lease ends once its first token was sent on (on_finished runs after the prefill role's)
        end = time.monotonic() if traced.lease else request.finished_time or time.monotonic()
        (self._lease_phases if traced.lease else self._request_phases)(traced, request, end)
        attributes = {**traced.attributes, "gen_ai.usage.output_tokens": len(request.output_token_ids),
                      "pdserve.cached_tokens": request.num_cached_tokens, "pdserve.steps": traced.steps,
                      "pdserve.finish_reason": request.status.finish_reason or ""}
        failed = request.first_token_time is None
        self.tracer.end(traced.span, end, attributes, error="ended before its first token" if failed else "")

    def _request_phases(self, traced: _Traced, req: Request, end: float) -> None:
        tracer, span = self.tracer, traced.span
        scheduled = req.first_scheduled_time or req.arrival_time
        first = req.first_token_time
        tracer.phase(span, "decode.queue", req.arrival_time, scheduled, "queue")
        if first is None:
            return
        if req.kv_landed_time is not None:
            waited = max(0.0, req.kv_landed_time - scheduled)
            remote = min(req.remote_queue_s + req.remote_compute_s, waited)  # the prefill worker's own spans
            tracer.phase(span, "decode.kv_wait", scheduled + remote, req.kv_landed_time, "transfer",
                         {"pdserve.remote_queue_s": req.remote_queue_s,
                          "pdserve.remote_compute_s": req.remote_compute_s})
        else:
            tracer.phase(span, "decode.prefill", scheduled, first, "prefill", events=traced.chunks)
        tracer.phase(span, "decode.generate", first, end, "decode", {"gen_ai.usage.output_tokens":
                                                                     len(req.output_token_ids)},
                     events=[("first_token", first, {})])

    def _lease_phases(self, traced: _Traced, req: Request, end: float) -> None:
        tracer, span = self.tracer, traced.span
        scheduled = req.first_scheduled_time or req.arrival_time
        computed = req.first_token_time or end
        tracer.phase(span, "prefill.queue", req.arrival_time, scheduled, "queue")
        tracer.phase(span, "prefill.compute", scheduled, computed, "prefill", events=traced.chunks)
        sent_from = traced.chunks[0][1] if traced.chunks else scheduled
        tracer.phase(span, "prefill.kv_send", sent_from, time.monotonic(), attributes={
            key: value for key, value in traced.attributes.items() if key.startswith("pdserve.kv.")})
