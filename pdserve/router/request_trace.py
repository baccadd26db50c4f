"""One request's spans at the router (with `--otlp-traces-endpoint`; pdserve/telemetry/tracing.py).

The request's span (`chat <model>` or `text_completion <model>`, a server span) is a child of the
client's `traceparent` header where it sent a valid one, else the root of a new trace. It holds:
- `router.queue`: from arrival to the decode worker chosen (tokenizing, admission, the router's
  waiting line);
- each call to a decode worker: the first one's spans are children of the request's span; a
  call after a move, a failure, a resume or a full queue gets a `router.<reason>` span, linked
  to the call before it, and the new call's spans are its children;
- attributes: tokens in and out, the route (decode and prefill worker), calls, outcome; the first
  token as an event.
"""

from __future__ import annotations

import time

from pdserve.telemetry.tracing import Tracer, valid_traceparent


class RequestTrace:
    def __init__(self, tracer: Tracer, traceparent: str | None, chat: bool, model: str, request_id: str) -> None:
        self.tracer = tracer
        operation = "chat" if chat else "text_completion"
        self.start = time.monotonic()
        self.span = tracer.begin(f"{operation} {model}", self.start, valid_traceparent(traceparent),
                                 {"gen_ai.operation.name": operation, "gen_ai.request.model": model,
                                  "pdserve.request_id": request_id}, server=True)
        self.calls: list[str] = []  # the context each call to a decode worker carried

    def admitted(self, decode_id: str, prefill_id: str | None) -> None:
        now = time.monotonic()
        self.tracer.phase(self.span, "router.queue", self.start, now, "router_queue")
        self.span.set_attributes({"pdserve.route.decode_worker": decode_id,
                                  "pdserve.route.prefill_worker": prefill_id or "",
                                  "pdserve.route.disaggregated": prefill_id is not None})

    def call(self, decode_id: str, prefill_id: str | None, reason: str) -> str:
        """The traceparent a call to decode worker `decode_id` carries: the request's span for the
        first, else a `router.<reason>` span linked to the call before."""
        if not self.calls:
            parent = self.span
        else:
            now = time.monotonic()
            parent = self.tracer.begin(f"router.{reason}", now, self.span,
                                       {"pdserve.route.decode_worker": decode_id,
                                        "pdserve.route.prefill_worker": prefill_id or ""}, links=self.calls[-1:])
            parent.end()
        context = self.tracer.traceparent(parent)
        self.calls.append(context)
        return context

    def first_token(self) -> None:
        self.tracer.event(self.span, "first_token", time.monotonic())

    def finish(self, outcome: str, prompt_tokens: int, output_tokens: int) -> None:
        self.tracer.end(self.span, time.monotonic(), {
            "gen_ai.usage.input_tokens": prompt_tokens, "gen_ai.usage.output_tokens": output_tokens,
            "pdserve.calls": len(self.calls), "pdserve.outcome": outcome}, error="" if outcome != "error" else outcome)
