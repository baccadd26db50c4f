"""The router's state and its decisions, without HTTP: the registered workers, the prefix index,
admission bounds, the requests streaming now and those waiting in line; which workers take a
request (`route`, `admit`), and forgetting a worker that failed or missed its lease. The HTTP
app (`app.py`), a request's owner (`request_stream.py`) and the background rounds (`rounds.py`)
each act through it."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from pdserve import wire
from pdserve.http_errors import APIError
from pdserve.router import routing
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.hot_prefixes import HotPrefixes
from pdserve.router.peers import Peers
from pdserve.router.policy import Admission, PrefixIndex
from pdserve.router.registry import Registry, WorkerEntry
from pdserve.router.replicas import PrefixReplicas
from pdserve.router.rollout import Rollout
from pdserve.router.shadow import Shadow
from pdserve.router.streams import LiveStream, NoRoom, abort_on_worker
from pdserve.router.tool_calls import ToolCalls, choose
from pdserve.router.waiting_line import Admitted, Hold, WaitingLine
from pdserve.structure import Grammars
from pdserve.telemetry.tracing import tracer_for
from pdserve.tokenizer import Tokenizer

log = logging.getLogger("pdserve.router")

HEARTBEAT_S = 1.0  # how often workers report their load (and renew their lease), at most
FILL_POLL_S = 0.05  # how often a fresh router's held request looks for a registered worker


class Router:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, model_hash: str, vocab_size: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        eos = (tokenizer.eos_token_id,) if tokenizer is not None and tokenizer.eos_token_id is not None else ()
        self.grammars = Grammars(tokenizer, vocab_size, eos)  # structured outputs, checked before admission
        self.tool_calls = ToolCalls(choose(config.tool_call_parser, tokenizer.chat_template if tokenizer else None),
                                    tokenizer)
        log.info("tool calls: %s format (--tool-call-parser %s)", self.tool_calls.format.name,
                 config.tool_call_parser)
        self.registry = Registry(model_hash, config.worker_token, config.lease_s)
        self.index = PrefixIndex()
        self.replicas = (PrefixReplicas(self, HotPrefixes(config.hot_prefix_rate, config.hot_prefix_window_s))
                         if config.hot_prefix_rate > 0 else None)  # hot prefixes copied to more decode workers
        self.admission = Admission(config.max_queued_requests, config.max_queued_tokens)
        self.metrics = RouterMetrics(config.ttft_slo_s, config.tpot_slo_s)
        self.tracer = tracer_for(config.otlp_traces_endpoint, "pdserve-router")  # None: tracing off
        self.rollout = Rollout(stable=config.stable_version)  # which version new requests go to
        self.metrics.track_rollout(self.rollout)
        self.shadow: Shadow | None = None  # a share of requests copied to another version (admin API)
        self.peers = Peers("", [])  # the other routers of the cluster, and which one leads (`peers.py`)
        self.metrics.track_leading(lambda: self.leading)
        self.metrics.track_shadow(lambda: self.shadow)
        self.http: httpx.AsyncClient | None = None
        self.live: dict[str, LiveStream] = {}  # requests streaming from decode workers, by id
        self.line = WaitingLine()  # admitted requests waiting for a decode worker with room
        self.started = time.monotonic()
        # every worker heartbeats (and, to a router that does not know it, registers) at least this often
        self.heartbeat_s = min(HEARTBEAT_S, config.lease_s / 3)
        self.fill_s = 2 * self.heartbeat_s + 0.5  # its next heartbeat, and one more should the first race the start

    # -- choosing workers -----------------------------------------------------------------------

    def require_workers(self) -> None:
        """503 now (not an error inside a 200 stream) when no worker could take a request."""
        if not self.version_workers(None):
            raise APIError(503, "no worker is available", "service_unavailable", headers={"Retry-After": "1"})

    @property
    def leading(self) -> bool:
        """Whether this router acts for the cluster now (`peers.py`): the leader, once it has heard
        the workers' heartbeats since it started."""
        return self.peers.leading and time.monotonic() - self.started >= self.fill_s

    async def await_workers(self) -> None:
        """`require_workers`, except in a router's first `fill_s`: a router that just started (or
        restarted) has not heard the workers' next heartbeats yet, which register them again, so
        it holds the request until a worker is there rather than refuse it for want of one."""
        while not self.version_workers(None):
            left = self.started + self.fill_s - time.monotonic()
            if left <= 0:
                self.require_workers()
            await asyncio.sleep(min(FILL_POLL_S, max(left, 0.0)))

    def route(self, prompt_ids: list[int], exclude: frozenset[str] = frozenset(), sequences: int = 1,
              version: str | None = None, fallback: bool = True) -> tuple[WorkerEntry, WorkerEntry | None]:
        """(decode worker, prefill worker or None) for a prompt of `sequences` completions, with
        `sequences` of the decode worker's capacity held for it (the caller releases them), among
        the workers of `version` (None: the stable version; with `fallback`, the stable version's
        where it has none left). Raises NoRoom when every decode worker holds as many sequences
        from here as it said it can."""
        entries = {w.worker_id: w for w in self.version_workers(version, fallback) if not w.stats.draining}
        workers = [routing.Candidate(k, w.role, w.current_load(), w.has_room(sequences), w.block_size, w.stats.kv_store)
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
            if r.worker_id == d.worker_id and self.replicas is not None:
                self.replicas.observe(prompt_ids, r.block_size, r.hashes)
        d.in_flight += sequences
        return d, p

    def version_workers(self, version: str | None, fallback: bool = True) -> list[WorkerEntry]:
        """The workers a request of `version` may use: that version's, or, where it has none (a
        canary whose workers all left) and `fallback`, the stable version's."""
        stable = self.rollout.stable
        chosen = self.registry.workers(version=stable if version is None else version)
        if not chosen and fallback and version is not None and version != stable:
            chosen = self.registry.workers(version=stable)
        return chosen

    # -- a request ------------------------------------------------------------------------------

    async def admit(self, prompt_ids: list[int], sequences: int, version: str | None = None) -> Admitted:
        """A decode worker (and prefill worker, if any) of `version` with room for the request, held
        for it: at once, or after waiting in line (first come, first served). At `queue_timeout_s`
        without room, NoRoom: a 503 with Retry-After, before any byte of the response, streamed or not."""
        deadline = time.monotonic() + self.config.queue_timeout_s
        chosen = self.route_or_none(prompt_ids, frozenset(), sequences, version)
        if chosen is None:
            chosen = await self.route_when_room(prompt_ids, frozenset(), sequences, deadline, version)
        return Admitted(*chosen, deadline, Hold(self.line, chosen[0], sequences))

    def stop_completion(self, request_id: str, index: int) -> None:
        """The router found completion `index`'s stop string: its worker stops computing it."""
        live = self.live.get(request_id)
        worker = self.registry.get(live.worker_id) if live is not None else None
        if worker is not None:
            abort_on_worker(self.http, worker.url, live.worker_request_id, self.worker_headers, index)

    def route_or_none(self, prompt_ids: list[int], exclude: frozenset[str], sequences: int,
                      version: str | None = None, fallback: bool = True
                      ) -> tuple[WorkerEntry, WorkerEntry | None] | None:
        """What `route` chooses, or None where no worker has room (or, without `fallback`, none
        of `version` is registered)."""
        try:
            return self.route(prompt_ids, exclude, sequences, version, fallback)
        except NoRoom:
            return None
        except APIError:
            if fallback:
                raise
            return None

    async def route_when_room(self, prompt_ids: list[int], exclude: frozenset[str], sequences: int,
                              deadline: float, version: str | None = None) -> tuple[WorkerEntry, WorkerEntry | None]:
        """Wait in line until a decode worker of `version` has room; 503 at `deadline`."""
        self.metrics.requeued.inc()
        return await self.line.wait(lambda: self.route_or_none(prompt_ids, exclude, sequences, version), deadline,
                                    NoRoom)

    @property
    def worker_headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.config.worker_token:
            headers["Authorization"] = f"Bearer {self.config.worker_token}"
        return headers

    async def move_stream(self, live: LiveStream, hot: WorkerEntry, target: WorkerEntry) -> bool:
        """Hot-spot relief: `live` continues on `target`, which takes its KV from `hot`, once `hot`
        stops it (asked here by an abort: its last line ends the call, and the stream moves on).
        False if `hot` could not be asked (the failure path takes the stream over)."""
        live.ask_to_move(target)
        try:
            await self.http.post(hot.url + "/v1/abort", content=wire.encode(wire.AbortRequest(
                request_id=live.worker_request_id)), headers=self.worker_headers, timeout=5.0)
        except httpx.HTTPError:
            live.cancel_move()
            return False
        return True

    # -- workers that leave ---------------------------------------------------------------------

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
