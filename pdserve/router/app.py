"""The router: OpenAI-compatible HTTP in front, registered workers behind.

Lifecycle of a request:
1. Validate (shape, model, API key), tokenize (chat template for chat), check lengths.
2. Admit under the router's bounds (requests and prompt tokens held), else 429 with Retry-After.
3. Choose a decode worker (policy score; a prefill worker serves colocated when no decode worker
   lives, and 503 when none lives at all) and, if the prompt's uncached part is worth it and the
   prefill pool is not saturated, a prefill worker (least work, counting its prefix cache).
4. Stream the decode worker's token deltas back as OpenAI JSON or SSE. A decode worker that fails
   before the first token is retried once on another; one that fails later (or misses its lease)
   ends the stream with an error event, or with `--migrate-on-failure` continues on another. A
   client that goes away closes the worker stream, and the worker aborts.
5. While it runs, hot-spot relief may move it to a cooler decode worker, which takes its KV from
   the hot one through the transfer engine; the client's stream goes on without a gap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from pdserve import wire
from pdserve.http_errors import APIError, install_error_handlers, require_bearer
from pdserve.http_guard import BearerRule, BodyLimits, HTTPGuard
from pdserve.router import routing
from pdserve.router.admin import add_admin_routes
from pdserve.router.membership import add_membership_routes
from pdserve.router.policy import Admission, DecodeWeights, DisaggregationPolicy, HotSpotRelief, PrefixIndex
from pdserve.router.metrics import RouterMetrics
from pdserve.router.rebalance import ControllerState, RebalancePolicy
from pdserve.router.protocol import ChatCompletionRequest, CompletionRequest, now
from pdserve.router.registry import Registry, WorkerEntry
from pdserve.router.responses import serve
from pdserve.router.rounds import reap
from pdserve.router.request_stream import RequestStream
from pdserve.router.streams import LiveStream, NoRoom, abort_on_worker
from pdserve.router.waiting_line import Admitted, Hold, WaitingLine
from pdserve.tokenizer import Tokenizer

log = logging.getLogger("pdserve.router")


@dataclass
class RouterConfig:
    model_name: str
    max_model_len: int
    api_key: str = ""
    worker_token: str = ""
    admin_key: str = ""  # the admin API's Bearer key; none: no admin API
    lease_s: float = 10.0
    decode_weights: DecodeWeights = field(default_factory=DecodeWeights)
    disaggregation: DisaggregationPolicy = field(default_factory=DisaggregationPolicy)
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1 << 20
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    max_body_bytes: int = 8 << 20
    keepalive_s: float = 5.0  # SSE comment after this long without a token
    max_tokens_default: int = 1024  # max_tokens of a chat request that sets none (within the context left)
    worker_silence_s: float = 60.0  # a worker stream with no line (workers send keep-alives) for this long is lost
    queue_timeout_s: float = 300.0  # a request admitted here waits at most this long for a worker with room
    client_stall_s: float = 30.0  # a client that reads nothing for this long, with output waiting, is dropped
    migrate_on_failure: bool = False  # a decode worker lost mid-stream: continue on another
    migrate_hot_spots: bool = True  # move running requests off decode workers past the hot KV use
    relief: HotSpotRelief = field(default_factory=HotSpotRelief)
    rebalance: RebalancePolicy | None = None  # the P:D controller moves workers between pools; None: off


class Router:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, model_hash: str, vocab_size: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.registry = Registry(model_hash, config.worker_token, config.lease_s)
        self.index = PrefixIndex()
        self.admission = Admission(config.max_queued_requests, config.max_queued_tokens)
        self.metrics = RouterMetrics(config.ttft_slo_s, config.tpot_slo_s)
        self.http: httpx.AsyncClient | None = None
        self.live: dict[str, LiveStream] = {}  # requests streaming from decode workers, by id
        self.line = WaitingLine()  # admitted requests waiting for a decode worker with room
        self.relieved_at: dict[str, int] = {}  # worker id -> its heartbeat count at its last move
        self.controller = ControllerState()
        self.controller_said: tuple[str, str | None] | None = None  # the last (stage, wanted) it logged

    # -- choosing workers -----------------------------------------------------------------------

    def require_workers(self) -> None:
        """503 now (not an error inside a 200 stream) when no worker could take a request."""
        if not self.registry.workers():
            raise APIError(503, "no worker is available", "service_unavailable", headers={"Retry-After": "1"})

    def route(self, prompt_ids: list[int], exclude: frozenset[str] = frozenset(), sequences: int = 1
              ) -> tuple[Any, Any]:
        """(decode worker, prefill worker or None) for a prompt of `sequences` completions, with
        `sequences` of the decode worker's capacity held for it (the caller releases them). Raises
        NoRoom when every decode worker holds as many sequences from here as it said it can."""
        entries = {w.worker_id: w for w in self.registry.workers() if not w.stats.draining}
        workers = [routing.Candidate(k, w.role, w.current_load(), w.has_room(sequences), w.block_size)
                   for k, w in entries.items()]
        try:
            decision = routing.route(workers, prompt_ids, self.index, self.config.decode_weights,
                                     self.config.disaggregation, exclude)
        except routing.NoWorker:
            raise APIError(503, "no worker is available", "service_unavailable", headers={"Retry-After": "1"}) from None
        except routing.NoRoom:
            raise NoRoom() from None
        d = entries[decision.decode_id]
        p = entries[decision.prefill_id] if decision.prefill_id is not None else None
        if p is not None:
            self.registry.note_routed(p.worker_id, decision.prefill_uncached)
            self.metrics.disaggregated.inc()
        self.registry.note_routed(d.worker_id, 0 if p else decision.decode_uncached, remote=p is not None)
        for r in decision.records:
            self.index.record(r.worker_id, r.block_size, r.hashes)
        d.in_flight += sequences
        return d, p

    # -- a request ------------------------------------------------------------------------------

    def prepare(self, req: CompletionRequest | ChatCompletionRequest) -> tuple[list[int], dict[str, Any]]:
        if req.model != self.config.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                                f"{self.config.model_name!r}", "not_found_error", "model")
        if req.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if isinstance(req, CompletionRequest) and req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if isinstance(req, ChatCompletionRequest):
            try:
                messages = [{"role": m.role, "content": m.text()} for m in req.messages]
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
            max_tokens = req.max_completion_tokens or req.max_tokens
        else:
            if isinstance(req.prompt, str):
                ids = self.tokenizer.encode(req.prompt)
            else:
                ids = list(req.prompt)
                if any(not 0 <= t < self.vocab_size for t in ids):
                    raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
            max_tokens = req.max_tokens if req.max_tokens is not None else 16
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        limit = self.config.max_model_len
        if max_tokens is None:  # never the whole context by default: n of those would hold the pool for minutes
            max_tokens = max(1, min(self.config.max_tokens_default, limit - len(ids)))
        if max_tokens < 1 or len(ids) + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has "
                                f"{len(ids)} and max_tokens asks for {max_tokens}", param="max_tokens")
        return ids, req.sampling(max_tokens)

    async def admit(self, prompt_ids: list[int], sequences: int) -> Admitted:
        """A decode worker (and prefill worker, if any) with room for the request, held for it: at
        once, or after waiting in line (first come, first served). At `queue_timeout_s` without
        room, NoRoom: a 503 with Retry-After, before any byte of the response, streamed or not."""
        deadline = time.monotonic() + self.config.queue_timeout_s
        chosen = self.route_or_none(prompt_ids, frozenset(), sequences)
        if chosen is None:
            chosen = await self.route_when_room(prompt_ids, frozenset(), sequences, deadline)
        return Admitted(*chosen, deadline, Hold(self.line, chosen[0], sequences))

    def worker_stream(self, request_id: str, prompt_ids: list[int], sampling: wire.Sampling, priority: int,
                      admitted: Admitted) -> AsyncIterator[wire.OutputLine]:
        """The request's output lines, from the `admitted` workers on, followed across workers by
        its owner (`request_stream.py`)."""
        return RequestStream(self, request_id, prompt_ids, sampling, priority, admitted).lines()

    def stop_completion(self, request_id: str, index: int) -> None:
        """The router found completion `index`'s stop string: its worker stops computing it."""
        live = self.live.get(request_id)
        worker = self.registry.get(live.worker_id) if live is not None else None
        if worker is not None:
            abort_on_worker(self.http, worker.url, live.worker_request_id, self.worker_headers, index)

    def route_or_none(self, prompt_ids: list[int], exclude: frozenset[str], sequences: int
                       ) -> tuple[Any, Any] | None:
        try:
            return self.route(prompt_ids, exclude, sequences)
        except NoRoom:
            return None

    async def route_when_room(self, prompt_ids: list[int], exclude: frozenset[str], sequences: int,
                               deadline: float) -> tuple[Any, Any]:
        """Wait in line until a decode worker has room; 503 at `deadline`."""
        self.metrics.requeued.inc()
        return await self.line.wait(lambda: self.route_or_none(prompt_ids, exclude, sequences), deadline, NoRoom)

    @property
    def worker_headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.config.worker_token:
            headers["Authorization"] = f"Bearer {self.config.worker_token}"
        return headers

    # -- the reaper's rounds ---------------------------------------------------------------------

    def drop_expired_workers(self) -> None:
        """Workers whose lease lapsed leave the registry; streams waiting on them fail now."""
        for entry in self.registry.expire():
            self._forget_worker(entry, "it missed its lease")

    def drop_worker(self, worker_id: str, reason: str) -> None:
        """Take a failing worker out of the registry: every stream still waiting on it fails now
        (and retries or migrates as its own rules say), not when its lease would have lapsed."""
        entry = self.registry.remove(worker_id)
        if entry is not None:
            self._forget_worker(entry, reason)

    def _forget_worker(self, entry: WorkerEntry, reason: str) -> None:
        log.warning("worker %s (%s, %s) dropped: %s", entry.worker_id, entry.role, entry.url, reason)
        self.metrics.workers_dropped.inc()
        self.index.forget(entry.worker_id)
        for live in self.live.values():
            if live.worker_id == entry.worker_id:
                live.worker_lost(f"worker {entry.url} was dropped: {reason}")

def create_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # No pool cap of its own: admission bounds the streams, and a request waiting for a pooled
        # connection must never time out and be taken for a failed worker.
        router.http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None, pool=None),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        reaper = asyncio.create_task(reap(router))
        yield
        reaper.cancel()
        await router.http.aclose()

    app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None, lifespan=lifespan)
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
        return {"status": "ok" if workers else "no workers", "workers": len(workers), "roles": roles}

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
