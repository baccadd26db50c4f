"""The worker's control endpoint (HTTP, FastAPI): token ids in, streamed token ids out.

Routes (the messages are pdserve/wire.py's; a body that is not one is a 400 naming the field):
- POST /v1/generate   GenerateRequest -> NDJSON OutputLines (output_token_ids resumes a request begun elsewhere)
- POST /v1/abort      AbortRequest (a request, or one completion of n: `index`)
- POST /v1/prefill    PrefillLease, a decode worker's (any role: decode workers serve it for migrations)
- POST /v1/prefill/abort AbortRequest with the lease's fence
- POST /v1/drain      take nothing new, finish what is held, leave the router, exit (worker/drain.py)
- POST /v1/role       RoleChange: drain in place, then register again in the new role (no restart)
- GET  /v1/kv_info    KVInfo: how prefill workers reach this one (decode and both roles)
- POST /v1/faults/cut-kv-links  a testing aid, 403 unless the worker runs with `--fault-injection`:
                      close every KV connection of this worker at once (`Worker.cut_kv_links`)
- POST /v1/faults/slow-steps    SlowSteps: the same aid: each engine step takes `delay_ms` longer
- GET  /stats (WorkerStats), /health, /metrics (Prometheus)
Errors are `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status. With a token
set, every route but /health wants `Authorization: Bearer <token>`, compared in constant time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pdserve import wire
from pdserve.http_clients import ClientGone, ClosingStreamingResponse, unless_disconnected
from pdserve.http_errors import error, install_error_handlers, message_body, require_bearer
from pdserve.http_guard import BearerRule, BodyLimits, HTTPGuard
from pdserve.errors import LayoutMismatch, TransferError
from pdserve.net import WORKER_LIMITS, ServerLimits, http_server, tcp_listener
from pdserve.worker.metrics import render_metrics
from pdserve.worker.output_stream import KEEPALIVE_S, OutputStream
from pdserve.worker.refusals import DrainingError, EngineBusyError, QueueFullError, RoleNotServedError
from pdserve.worker.worker import Worker

_ids = itertools.count()


def create_app(worker: Worker, token: str = "", body_limits: BodyLimits = BodyLimits(max_bytes=16 << 20),
               fault_injection: bool = False) -> FastAPI:
    """`body_limits`: prompts come as token-id lists, about 7 bytes a token in JSON, so 16 MiB holds
    a prompt and its resumed output past two million tokens, with a prefill lease's block table.
    `fault_injection`: serve the fault-injection route (benchmarks and tests that break things on
    purpose); off, it answers 403."""
    app = FastAPI(title="pdserve worker", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    # the token checked and the body read within its limits before any handler parses a byte
    app.add_middleware(HTTPGuard, limits=body_limits, rules=(BearerRule("/health", ""), BearerRule("/", token)))

    async def authorized(request: Request) -> None:
        require_bearer(request, token)

    guarded = [Depends(authorized)]

    def answer(message: msgspec.Struct) -> Response:
        return Response(wire.encode(message), media_type="application/json")

    @app.post("/v1/generate", dependencies=guarded)
    async def generate(request: Request):
        body = await message_body(request, wire.GenerateRequest)
        request_id = body.request_id or f"gen-{next(_ids)}"
        stream = OutputStream(asyncio.get_running_loop(), lambda: worker.abort(request_id))
        try:
            await worker.generate(request_id, body.prompt_token_ids, body.sampling, stream.sink, body.priority,
                                  body.prefill_url, body.output_token_ids, body.resume_of, body.traceparent)
        except ValueError as e:
            return error(400, str(e))
        except (QueueFullError, EngineBusyError, DrainingError) as e:
            return error(503, str(e), "overloaded")
        except RoleNotServedError as e:
            return error(404, str(e))

        lines = stream.lines(KEEPALIVE_S, lambda: worker.healthy)
        if body.stream:
            return ClosingStreamingResponse(lines, media_type="application/x-ndjson")

        async def collect() -> bytes:
            async with contextlib.aclosing(lines) as items:  # leaving early aborts the request
                return b"[" + b",".join([line.strip() async for line in items if line.strip()]) + b"]"
        try:
            return Response(await unless_disconnected(request, collect()), media_type="application/json")
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the request was aborted

    @app.post("/v1/abort", dependencies=guarded)
    async def abort(request: Request):
        body = await message_body(request, wire.AbortRequest)
        if body.index is None:
            worker.abort(body.request_id)
        else:
            worker.stop_completion(body.request_id, body.index)
        return answer(wire.Aborted(request_id=body.request_id))

    @app.post("/v1/prefill", dependencies=guarded)
    async def prefill(request: Request):
        body = await message_body(request, wire.PrefillLease)
        try:
            engine_id, backend = await worker.accept_prefill(body)
        except ValueError as e:
            return error(400, str(e))
        except EngineBusyError as e:
            return error(503, str(e), "overloaded")
        except LayoutMismatch as e:
            return error(409, str(e), "kv_transfer_error")
        except TransferError as e:
            return error(503, str(e), "kv_transfer_error")
        return answer(wire.PrefillAccepted(request_id=body.request_id, fence=body.fence, backend=backend))

    @app.post("/v1/drain", dependencies=guarded)
    async def drain():
        worker.drain_requested()
        return {"draining": True}

    @app.post("/v1/role", dependencies=guarded)
    async def role(request: Request):
        body = await message_body(request, wire.RoleChange)
        if worker.draining:
            return error(409, "the worker is draining or already changing its role", "conflict")
        threading.Thread(target=worker.change_role, args=(body.role,), name="role-change", daemon=True).start()
        return {"role": body.role, "state": "changing"}

    @app.post("/v1/prefill/abort", dependencies=guarded)
    async def prefill_abort(request: Request):
        body = await message_body(request, wire.AbortRequest)
        worker.abort_prefill(body.request_id, body.fence)
        return answer(wire.Aborted(request_id=body.request_id))

    @app.post("/v1/faults/cut-kv-links", dependencies=guarded)
    async def cut_kv_links():
        if not fault_injection:
            return error(403, "fault injection is off on this worker (it runs with --fault-injection only)",
                         "permission_error")
        return await asyncio.to_thread(worker.cut_kv_links)

    @app.post("/v1/faults/slow-steps", dependencies=guarded)
    async def slow_steps(request: Request):
        if not fault_injection:
            return error(403, "fault injection is off on this worker (it runs with --fault-injection only)",
                         "permission_error")
        body = await message_body(request, wire.SlowSteps)
        worker.slow_steps(body.delay_ms / 1e3)
        return {"delay_ms": body.delay_ms}

    @app.get("/v1/kv_info", dependencies=guarded)
    async def kv_info():
        try:
            return answer(worker.kv_info())
        except RoleNotServedError as e:
            return error(404, str(e))

    @app.get("/stats", dependencies=guarded)
    async def stats():
        return answer(await asyncio.to_thread(worker.stats))

    @app.get("/health")
    async def health():
        return JSONResponse(worker.health(), 200 if worker.healthy and not worker.draining else 503)

    @app.get("/metrics", dependencies=guarded)
    async def metrics():
        return PlainTextResponse(render_metrics((await asyncio.to_thread(worker.stats)).as_dict()),
                                 media_type="text/plain; version=0.0.4")

    return app


class ServerThread:
    """A uvicorn server on a thread (for `bench-transfer` and tests), built as `pdserve worker` builds
    its own unless told other `limits`: `url` once started."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, lifespan: str = "off",
                 limits: ServerLimits = WORKER_LIMITS) -> None:
        import threading

        self._sock = tcp_listener(host, port)
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        self.server = http_server(app, limits, lifespan)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        import time

        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the worker's HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self._sock.close()
