"""The worker's control endpoint (HTTP, FastAPI): token ids in, streamed token ids out.

Routes:
- POST /v1/generate   {prompt_token_ids, output_token_ids?, sampling, priority, prefill_url?, stream}
                      -> NDJSON lines (output_token_ids resumes a request begun elsewhere)
- POST /v1/abort      {request_id}
- POST /v1/prefill    a decode worker's lease (any role: decode workers serve it for migrations)
- POST /v1/prefill/abort {request_id, fence}
- GET  /v1/kv_info    how prefill workers reach this one (decode and both roles)
- GET  /stats, /health, /metrics (Prometheus)
Errors are `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status. With a token
set, every route but /health wants `Authorization: Bearer <token>`, compared in constant time.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from pdserve.http_errors import error, install_error_handlers, require_bearer
from pdserve.kv_transfer.base import TransferError
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams
from pdserve.worker.metrics import render_metrics
from pdserve.worker.worker import QueueFullError, RoleNotServedError, Worker

_ids = itertools.count()


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str | None = Field(default=None, max_length=256)
    prompt_token_ids: list[StrictInt] = Field(min_length=1)
    output_token_ids: list[StrictInt] = Field(default_factory=list)  # resume: generated elsewhere so far
    sampling: dict[str, Any] = Field(default_factory=dict)
    priority: int = 0
    prefill_url: str | None = None
    stream: bool = True


class PrefillBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str = Field(max_length=256)
    fence: StrictInt = Field(ge=0)
    prompt_token_ids: list[StrictInt] = Field(min_length=1)
    output_token_ids: list[StrictInt] = Field(default_factory=list)
    sampling: dict[str, Any]
    start: StrictInt = Field(ge=0)
    block_table: list[StrictInt]
    block_size: StrictInt = Field(ge=1)
    model_hash: str
    kv_transfer_dtype: str = "auto"
    decode: dict[str, dict[str, Any]]


class AbortBody(BaseModel):
    request_id: str
    fence: int | None = None


def sampling_params(raw: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**raw)
    except TypeError as e:
        raise ValueError(f"bad sampling parameters: {e}") from None


def output_line(out: RequestOutput) -> bytes:
    return json.dumps({
        "request_id": out.request_id,
        "outputs": [
            {"index": c.index, "token_ids": c.delta_token_ids, "text": c.delta_text, "finish_reason": c.finish_reason}
            for c in out.outputs
        ],
        "finished": out.finished,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        **({"phase_times": out.phase_times} if out.phase_times else {}),
    }).encode() + b"\n"


def create_app(worker: Worker, token: str = "") -> FastAPI:
    app = FastAPI(title="pdserve worker", docs_url=None, redoc_url=None)
    install_error_handlers(app)

    async def authorized(request: Request) -> None:
        require_bearer(request, token)

    guarded = [Depends(authorized)]

    @app.post("/v1/generate", dependencies=guarded)
    async def generate(body: GenerateBody):
        request_id = body.request_id or f"gen-{next(_ids)}"
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def sink(item) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, item)

        try:
            params = sampling_params(body.sampling)
            await asyncio.to_thread(worker.generate, request_id, body.prompt_token_ids, params, sink,
                                    body.priority, body.prefill_url, body.output_token_ids)
        except ValueError as e:
            return error(400, str(e))
        except QueueFullError as e:
            return error(503, str(e), "overloaded")
        except RoleNotServedError as e:
            return error(404, str(e))

        async def lines():
            finished = False
            try:
                while not finished:
                    item = await outputs.get()
                    if isinstance(item, BaseException):
                        yield json.dumps({"error": {"message": f"engine error: {item}", "type": "server_error",
                                                    "param": None, "code": 500}}).encode() + b"\n"
                        return
                    finished = item.finished
                    yield output_line(item)
            finally:
                if not finished:  # the client went away: abort
                    worker.abort(request_id)

        if body.stream:
            return StreamingResponse(lines(), media_type="application/x-ndjson")
        merged = [json.loads(line) async for line in lines()]
        return JSONResponse(merged)

    @app.post("/v1/abort", dependencies=guarded)
    async def abort(body: AbortBody):
        worker.abort(body.request_id)
        return {"request_id": body.request_id, "aborted": True}

    @app.post("/v1/prefill", dependencies=guarded)
    async def prefill(body: PrefillBody):
        try:
            engine_id, backend = await asyncio.to_thread(worker.accept_prefill, body.model_dump())
        except (ValueError, TypeError) as e:
            return error(400, str(e))
        except TransferError as e:
            status = 409 if "mismatch" in str(e) else 503
            return error(status, str(e), "kv_transfer_error")
        return {"request_id": body.request_id, "fence": body.fence, "backend": backend}

    @app.post("/v1/prefill/abort", dependencies=guarded)
    async def prefill_abort(body: AbortBody):
        worker.abort_prefill(body.request_id, body.fence)
        return {"request_id": body.request_id, "aborted": True}

    @app.get("/v1/kv_info", dependencies=guarded)
    async def kv_info():
        try:
            return worker.kv_info()
        except RoleNotServedError as e:
            return error(404, str(e))

    @app.get("/stats", dependencies=guarded)
    async def stats():
        return await asyncio.to_thread(worker.stats)

    @app.get("/health")
    async def health():
        return {"status": "ok", "role": worker.config.role}

    @app.get("/metrics", dependencies=guarded)
    async def metrics():
        return PlainTextResponse(render_metrics(await asyncio.to_thread(worker.stats)),
                                 media_type="text/plain; version=0.0.4")

    return app


class ServerThread:
    """A uvicorn server on a thread (for `bench-transfer` and tests): `url` once started."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, lifespan: str = "off") -> None:
        import threading

        import uvicorn

        from pdserve.net import tcp_listener

        self._sock = tcp_listener(host, port)
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan))
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
