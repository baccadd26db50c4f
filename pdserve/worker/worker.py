"""One worker process: the engine in its role, its KV transfer endpoints, and what the control
endpoint (server.py) calls.

Lifecycle:
1. Build the roles (decode: receiver and leases; every worker: senders, since a decode worker also
   ships the KV of requests the router migrates away from it), then the engine with them as its
   hooks; a decode worker offering `shm` keeps its KV pool in shared memory, and one given
   `--durable-kv` in that file, which outlives it (`engine/durable_kv.py`).
2. Decode: open the KV listener and publish the offers (tcp address, shared pool path).
3. `start()`: the engine thread runs; `generate`, `abort`, `prefill`, `stats` are safe from any
   thread.
4. `stop()`: the engine thread ends, connections close, the shared pool file is removed (a durable
   one is left to its supervisor, its journal naming what still ran).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import msgspec

from pdserve import wire
from pdserve.config import ROLES, EngineConfig
from pdserve.engine.durable_kv import durable_pool
from pdserve.engine.kv_tier import tier_stats
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import pool_ranks
from pdserve.worker.refusals import DrainingError, EngineBusyError, QueueFullError, RoleNotServedError
from pdserve.kv_transfer.base import DraftKV, KVLayout
from pdserve.models.arch_config import model_fingerprint
from pdserve.telemetry.tracing import Tracer, tracer_for
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.kv_transfer.registry import BACKENDS, PRODUCTION_BACKENDS, DecodeSide, offers, release, sender_types
from pdserve.kv_transfer.shm import SharedKVPool, shm_available
from pdserve.worker.config import WorkerConfig
from pdserve.worker.decode import DecodeRole
from pdserve.worker.engine_loop import EngineLoop, OutputSink
from pdserve.worker.prefill import PrefillRole
from pdserve.worker.hooks import WorkerHooks
from pdserve.worker.tracing import WorkerTracing


if TYPE_CHECKING:
    from pdserve.worker.registration import Memberships

log = logging.getLogger("pdserve.worker")

ADMIT_TIMEOUT_S = 30.0  # how long a request waits for the engine thread to take it before a 503
STATS_TIMEOUT_S = 2.0  # how long a stats reader waits for the engine before taking the last snapshot


class Worker:
    def __init__(self, config: EngineConfig, settings: WorkerConfig = WorkerConfig(), token: str = "",
                 name: str = "worker", tracer: Tracer | None = None) -> None:
        """An engine built from `config` in its role, served as `settings` say (addresses, KV
        transfer, queue bound, step log); `token` guards its KV connections. `tracer`: where its
        requests' spans go (default: `settings.otlp_traces_endpoint`'s collector, or none)."""
        transfer = settings.backends
        bad = [t for t in transfer if t not in BACKENDS]
        if bad:
            raise ValueError(f"--transfer takes a list of {', '.join(PRODUCTION_BACKENDS)}; got {transfer}")
        self.config, self.settings = config, settings
        self.transfer = transfer
        self.max_queued = settings.max_queued
        # Every worker has both sides of a transfer, whatever its role: decode workers ship KV out
        # too (for the requests hot-spot relief moves away), and a role is state, not identity
        # (`change_role`): any worker can become a decode worker without restarting.
        self.role = config.role
        self.decode = DecodeRole(settings.kv_lease_timeout, token, settings.kv_transfer_dtype)
        self.prefill = PrefillRole(sender_types(self.transfer), self.transfer, token, name)
        tracer = tracer or tracer_for(settings.otlp_traces_endpoint, "pdserve-worker", {"pdserve.worker": name})
        self.tracing = self.decode.tracing = self.prefill.tracing = (
            WorkerTracing(tracer, config.role) if tracer is not None else None)
        self._pool: SharedKVPool | None = None
        self.durable = durable_pool(settings.durable_kv, config)  # a pool that outlives this process

        def shared_pool(shape, dtype):
            self._pool = SharedKVPool(shape, dtype)
            return self._pool.tensor

        use_shm = "shm" in self.transfer and shm_available() and config.device == "cpu"
        allocator = self.durable.allocate if self.durable is not None else shared_pool if use_shm else None

        def build() -> LLMEngine:
            engine = LLMEngine(config, WorkerHooks(self.decode, self.prefill, self.tracing), allocator)
            if self.durable is not None:  # before warm-up, which takes blocks: what it kept is held first
                self.durable.recover(engine.block_manager)
                engine.scheduler.durable = self.durable
            if self.durable is None or not self.durable.held:  # held KV's streams wait: they come first
                log.info("engine warmed up in %.2f s", engine.warm_up())
            return engine

        self.engine = _built_on_own_thread(build)
        head = self.engine.runner.head
        self.layout = KVLayout.of(self.engine.model_config, self.engine.dtype, head.name if head is not None else "",
                                  pool_ranks(self.engine.runner.model)[0])
        self.model_hash = model_fingerprint(self.engine.model_config)  # the model it serves, for the router
        record_steps = settings.record_steps  # a JSONL file: every step's shape and time (see EngineLoop)
        if record_steps:
            Path(record_steps).parent.mkdir(parents=True, exist_ok=True)
        self._step_log = open(record_steps, "a", buffering=1 << 16) if record_steps else None
        self.loop = EngineLoop(self.engine, self._poll, self._step_log)
        draft_model = self.engine.draft_model
        draft = (DraftKV.of(draft_model.config, draft_model.weights, draft_model.runner.kv_cache)
                 if draft_model is not None else None)  # its KV travels with the target's
        self.receiver = KVReceiver(self.layout, self.engine.runner.kv_cache, queue.Queue(), token, settings.host,
                                   settings.kv_port, draft=draft)
        pool_path = self.durable.pool_path if self.durable is not None else self._pool.path if self._pool else None
        side = DecodeSide(self.layout, self.engine.runner.kv_cache, self.receiver.leases, token,
                          pool_path if use_shm else None, draft)
        # frames go here; a listener bound to 0.0.0.0 (a pod) must offer an address peers can reach
        addr = {"host": settings.advertise_host or self.receiver.address[0], "port": self.receiver.address[1]}
        self.offers: dict[str, dict] = offers(self.transfer, side, addr)
        if self.layout.ranks != config.tensor_parallel_size:  # GPUs: each rank's KV stays on its own device
            log.warning("tensor parallel on %s: this worker's KV is split across its devices; it neither ships "
                        "nor takes KV (its peers compute what they would have taken from it)", config.device)
            self.offers, self.prefill.sender_types = {}, {}
        self.decode.attach(self.engine, self.receiver, self.offers, self.loop.call)
        self.prefill.attach(self.engine, self.layout, self.loop.call, self.loop.submit, draft)
        self.started_at = time.time()
        self._last_stats = wire.WorkerStats(role=config.role, model_hash=self.model_hash)
        self.draining = False
        self._token = token
        self._drain_request: Callable[[], None] = self.drain  # POST /v1/drain (`on_drain_request`)
        self.membership: Memberships | None = None  # with a router (or several): `join`
        self._role_change = threading.Lock()

    def start(self) -> None:
        self.loop.start()

    def _poll(self) -> None:
        """The engine thread, between steps: the decode side's transfer events and timers, and a
        durable pool's journal."""
        self.decode.poll()
        if self.durable is not None:
            self.durable.tick(self.engine.scheduler.running)
            self.durable.expire()

    def join(self, router_url: str, own_url: str, token: str | None = None) -> Memberships:
        """Register with the router at `router_url` (or each of several, comma-separated, or those
        behind a dns+ name: router replicas, `router_addresses.py`) as the worker at `own_url`, and renew the lease by heartbeats of `stats` from now
        on; a role change or a drain is told to it at once. `token`: the router's worker token (by
        default this worker's own, as in a cluster)."""
        from pdserve.worker.registration import Memberships, RouterMembership

        token = self._token if token is None else token
        self.membership = Memberships(router_url, lambda url: RouterMembership(
            url, own_url, self.role, self.model_hash, self.stats, token, self.config.block_size,
            self.settings.node, self.settings.version)).start()
        return self.membership

    def on_drain_request(self, begin: Callable[[], None]) -> None:
        """What POST /v1/drain starts: by default draining in place (no new request; its next
        heartbeat tells the router); a worker process drains, then exits (`drain.Drain.begin`)."""
        self._drain_request = begin

    def drain_requested(self) -> None:
        self._drain_request()

    def stop(self) -> None:
        if self.membership is not None:
            self.membership.stop()
        self.loop.stop()
        if self.durable is not None:  # the engine thread has ended: what still runs is journaled
            self.durable.close(self.engine.scheduler.running)
        for part in (self.prefill, self.decode, self.receiver):
            part.close()
        release(self.transfer, self.engine.runner.kv_cache)
        if self._pool is not None:
            self._pool.close()
        if self._step_log is not None:
            self._step_log.close()
        self.engine.close()  # its tensor-parallel ranks, if it has any
        if self.tracing is not None:
            self.tracing.tracer.close()  # what is still batched goes out

    # -- requests (any thread) -----------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: wire.Sampling,
        sink: OutputSink,
        priority: int = 0,
        prefill_url: str | None = None,
        output_token_ids: list[int] = (),
        resume_of: str | None = None,
        traceparent: str = "",
    ) -> None:
        """Queue a request; its outputs go to `sink` from the engine thread. Raises ValueError
        for a bad request, QueueFullError when the queue is at its bound, EngineBusyError when the
        engine does not take it within ADMIT_TIMEOUT_S. No thread waits meanwhile: a burst of
        requests queues on the engine thread, not on a thread pool, and each is taken between
        two steps. A request whose KV a prefill worker computes hands that worker `sampling` as it
        came: each engine converts it once (`wire.Sampling.params`)."""
        if self.draining:
            raise DrainingError("the worker is draining; send the request elsewhere")
        if prefill_url and self.role == "prefill":
            raise RoleNotServedError("a prefill worker does not take KV from a prefill worker")

        params = sampling.params()
        received = time.monotonic()  # queueing starts now, not when the engine thread is free

        def add() -> None:
            sched = self.engine.scheduler
            held = len(sched.waiting) + sched.num_live
            if held and held + params.n > self.capacity:
                raise QueueFullError(f"the worker holds its maximum of {self.capacity} sequences, running and queued")
            remote = bool(prefill_url) and params.n == 1
            if remote:
                self.decode.targets[request_id] = (prefill_url, sampling)
            try:
                self.engine.add_request(request_id, {"prompt_token_ids": prompt_token_ids}, params, priority, remote,
                                        output_token_ids, received, resume_of)
            except Exception:
                if remote:
                    self.decode.targets.pop(request_id, None)
                raise
            self.loop.sinks[request_id] = sink
            if self.tracing is not None:
                self.tracing.begin_request(request_id, traceparent, received, len(prompt_token_ids), remote)

        await self._admitted(self.loop.submit(add), lambda: self.abort(request_id))

    @property
    def capacity(self) -> int:
        """Sequences it holds at most: as many running as the engine batches, and `max_queued` more."""
        return self.config.max_num_seqs + self.max_queued

    def abort(self, request_id: str) -> None:
        self.loop.call(lambda: self.engine.abort(request_id))

    def drain(self) -> None:
        """Take no new request from now on (its heartbeats say so: the router routes elsewhere, and
        moves its running requests off with their KV); what it holds runs to its end. Leases are
        still served: they are how its requests' KV leaves. Idempotent."""
        self.draining = True

    def change_role(self, role: str, timeout_s: float = 60.0) -> bool:
        """Become a `role` worker without restarting (blocking: run it on a thread of its own).
        Drained in place first: no new request, and the router, told at once, moves its running
        requests to other decode workers with their KV; whatever is left runs to its end, for at
        most `timeout_s`. Then the new role is announced by registering again. False if a change
        is already under way."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if not self._role_change.acquire(blocking=False):
            return False
        try:
            was, self.draining = self.draining, True
            if self.membership is not None:
                self.membership.beat_now()
            deadline = time.monotonic() + timeout_s
            while not self.idle() and time.monotonic() < deadline:
                time.sleep(0.05)
            log.info("role %s -> %s (%s)", self.role, role, "drained" if self.idle() else "drain timed out")
            self.role, self.draining = role, was
            if self.membership is not None:  # its stats now report the new role: it registers in it
                self.membership.beat_now()
            return True
        finally:
            self._role_change.release()

    def idle(self) -> bool:
        """Nothing running, queued, waiting for KV, or shipping KV."""
        s = self.stats()
        return not (s.stale or s.running or s.waiting or s.waiting_for_kv or s.kv_shipments or s.kv_leases_open)

    def stop_completion(self, request_id: str, index: int) -> None:
        self.loop.call(lambda: self.engine.stop_completion(request_id, index))

    async def accept_prefill(self, body: wire.PrefillLease) -> tuple[str, str]:
        """Check a lease and queue its prefill; returns (engine request id, backend). The checks and
        a first connection to the decode worker run on a thread; the wait for the engine does not."""
        engine_id, backend, admitted = await asyncio.to_thread(self.prefill.accept, body)
        await self._admitted(admitted, lambda: self.prefill_aborted(body))
        return engine_id, backend

    def prefill_aborted(self, body: wire.PrefillLease) -> None:
        self.abort_prefill(body.request_id, body.fence)

    async def _admitted(self, admitted: Future, undo: Callable[[], None]) -> None:
        """Wait for the engine thread to take a request; its refusal is raised here. A request not
        taken in time never will be (its turn is cancelled); one taken just as the wait ended is undone."""
        try:
            await asyncio.wait_for(asyncio.wrap_future(admitted), ADMIT_TIMEOUT_S)
        except TimeoutError:
            undo()
            raise EngineBusyError("the engine did not take the request in time; retry") from None

    def abort_prefill(self, request_id: str, fence: int | None) -> None:
        self.loop.call(lambda: self.prefill.abort(request_id, fence))

    def cut_kv_links(self) -> dict[str, int]:
        """Fault injection (a testing aid, served only with `--fault-injection`): close every KV
        connection this worker has, its links to decode workers and its prefill peers' connections
        to it, as a network fault would. Transfers in flight fail and take their fallback (the
        decode worker recomputes the prompt); the next lease connects again."""
        cut = {"sender_links": self.prefill.cut_links(), "receiver_connections": self.receiver.cut_connections()}
        log.warning("fault injection: cut %d KV links to decode workers and %d connections from prefill workers",
                    cut["sender_links"], cut["receiver_connections"])
        return cut

    def slow_steps(self, delay_s: float) -> None:
        """Fault injection: every engine step takes `delay_s` longer from now on (0: as fast as
        it is), as a worker on a slow or shared machine would."""
        self.loop.step_delay_s = delay_s
        log.warning("fault injection: each step now takes %.3f s longer", delay_s)

    def kv_info(self) -> wire.KVInfo:
        if self.role == "prefill":
            raise RoleNotServedError("a prefill worker receives no KV")
        return wire.KVInfo(layout=asdict(self.layout), backends=msgspec.convert(self.offers, wire.DecodeOffers))

    @property
    def healthy(self) -> bool:
        return self.loop.alive

    def health(self) -> dict:
        """For /health: the engine's state, and how the last exchange with the router went."""
        status = "engine stopped" if not self.healthy else "draining" if self.draining else "ok"
        out = {"status": status, "role": self.role}
        if self.membership is not None:
            out["router"] = self.membership.status
        return out

    def stats(self) -> wire.WorkerStats:
        """The worker's load and counters, read on the engine thread. A reader never waits long for
        a busy (or stopped) engine: it then gets the last snapshot, marked stale, so heartbeats
        keep the worker registered through a long step."""
        try:
            self._last_stats = self.loop.call_and_wait(self._stats, timeout=STATS_TIMEOUT_S)
            return self._last_stats
        except TimeoutError:
            return msgspec.structs.replace(self._last_stats, stale=True, engine_alive=self.loop.alive)

    def _stats(self) -> wire.WorkerStats:
        sched, blocks = self.engine.scheduler, self.engine.block_manager
        out = {
            "role": self.role,
            "model_hash": self.model_hash,
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "waiting_for_kv": len(sched.waiting_for_kv),
            "queued_prefill_tokens": sched.queued_prefill_tokens,
            "kv_blocks_total": blocks.num_blocks,
            "kv_blocks_used": blocks.num_blocks - blocks.num_free_blocks,
            "kv_blocks_free": blocks.num_free_blocks,
            "capacity": self.capacity,
            "step_token_budget": self.config.max_num_batched_tokens,
            "step_latency_ewma_ms": self.loop.step_latency_ewma_s * 1e3,
            "num_steps": self.loop.num_steps,
            "num_preemptions": sched.num_preemptions,
            "prefill_pauses": sched.num_prefill_pauses,
            "speculative": sched.proposer.method if sched.proposer is not None else "off",
            "drafts": sched.num_drafts,
            "draft_tokens": sched.num_drafted,
            "draft_tokens_accepted": sched.num_accepted,
            "draft_prompt_tokens": getattr(sched.proposer, "prompt_tokens_computed", 0),
            "tokens_by_source": dict(sched.tokens_by_source),
            "uptime_s": time.time() - self.started_at,
            "requests_aborted": self.engine.num_aborted,
            "requests_failed": self.engine.num_failed,
            "engine_alive": True,  # this ran on the engine thread
            "engine_failures": self.loop.num_failures,
            "draining": self.draining,
            **tier_stats(blocks.tier),
        }
        for part in (self.decode, self.prefill):
            out.update(part.stats())
        if self.durable is not None:
            out.update(self.durable.stats(), durable_kv=self.durable.identity)
        return wire.WorkerStats(**out)


def _built_on_own_thread(build: Callable[[], LLMEngine]) -> LLMEngine:
    """`build()` run on a thread that ends with it. OpenMP keeps a thread pool for each thread that
    ran a parallel region; with more of them than cores, every parallel region of a step waits for
    sleeping threads to wake (measured: a decode step twice as long as with one pool). Loading on a
    thread that exits frees its pool: the engine thread's own is then the only one."""
    with ThreadPoolExecutor(1, thread_name_prefix="engine-load") as load:  # its thread ends on leaving
        return load.submit(build).result()
