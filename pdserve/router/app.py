"""The router's HTTP app: OpenAI-compatible routes in front, registered workers behind.

Lifecycle of a request (each step names the module that owns it):
1. Validate (shape, model, API key), tokenize (chat template for chat), check lengths (`prompts.py`).
2. Admit under the router's bounds (requests and prompt tokens held), else 429 with Retry-After
   (`responses.py`, `policy.Admission`).
3. Choose a decode worker (policy score; a prefill worker serves colocated when no decode worker
   lives, and 503 when none lives at all) and, if the prompt's uncached part is worth it and the
   prefill pool is not saturated, a prefill worker (least work, counting its prefix cache); with
   no room anywhere, wait in line (`router.Router.admit`, `routing.py`, `waiting_line.py`).
4. Stream the decode worker's token deltas back as OpenAI JSON or SSE (`responses.py`), followed
   across workers by the request's owner (`request_stream.py`): a decode worker that fails before
   the first token is retried once on another; one that fails later (or misses its lease) ends
   the stream with an error event, or with `--migrate-on-failure` continues on another. A client
   that goes away closes the worker stream, and the worker aborts.
5. While it runs, hot-spot relief (`rounds.py`) may move it to a cooler decode worker, which takes
   its KV from the hot one through the transfer engine; the client's stream goes on without a gap.
"""
from __future__ import annotations

import asyncio
import contextlib

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from pdserve.http_errors import install_error_handlers, require_bearer
from pdserve.http_guard import BearerRule, BodyLimits, HTTPGuard
from pdserve.router.admin import add_admin_routes
from pdserve.router.membership import add_membership_routes
from pdserve.router.protocol import ChatCompletionRequest, CompletionRequest, now
from pdserve.router.responses import serve
from pdserve.router.rounds import Rounds
from pdserve.router.router import Router


def create_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # No pool cap of its own: admission bounds the streams, and a request waiting for a pooled
        # connection must never time out and be taken for a failed worker.
        router.http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None, pool=None),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        reaper = asyncio.create_task(app.state.rounds.run())
        yield
        reaper.cancel()
        await router.http.aclose()
        if router.tracer is not None:
            router.tracer.close()  # what is still batched goes out

    app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.rounds = Rounds(router)  # reaping, hot-spot relief, the P:D controller
    cfg = router.config

    install_error_handlers(app)

    # keys checked and bodies read within their limits before any handler parses a byte
    app.add_middleware(HTTPGuard, limits=BodyLimits(max_bytes=cfg.max_body_bytes), rules=(
        BearerRule("/v1", cfg.api_key, "API key"), BearerRule("/internal", cfg.worker_token, "worker token"),
        BearerRule("/admin", cfg.admin_key, "admin key")))
    if cfg.admin_key:  # no key, no admin routes: never open
        add_admin_routes(app, router)

    def check_key(request: Request) -> None:
        require_bearer(request, cfg.api_key, "API key")

    @app.get("/health")
    async def health():
        workers = router.registry.workers()
        roles = {role: sum(w.role == role for w in workers) for role in ("prefill", "decode", "both")}
        return {"status": "ok" if workers else "no workers", "workers": len(workers), "roles": roles,
                "leading": router.leading}

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(router.admission, router.registry.workers()),
                        media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": now(),
                                            "owned_by": "pdserve", "max_model_len": cfg.max_model_len,
                                            "vocab_size": router.vocab_size}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_key(request)
        return await serve(router, body, chat=False, request=request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_key(request)
        return await serve(router, body, chat=True, request=request)

    add_membership_routes(app, router)
    return app
