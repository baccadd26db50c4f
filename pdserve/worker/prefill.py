"""The prefill role: compute a prompt in chunks and push each layer's KV into the blocks a decode
worker leased, while the next layer computes; then notify it with the first sampled token.

Lifecycle of a lease on the prefill worker:
1. `accept` (HTTP thread): the lease is checked (model, sizes, and every block id it names: a bad
   one would aim an in-place write at other requests' blocks), a sender to the decode worker is
   taken from the pool or connected, trying the backends in this worker's order, and the request
   (one token to sample) is queued in the engine with its `Shipment`.
2. Each step (`before_execute`): KV this worker already had in its prefix cache beyond what decode
   had is queued for all layers at once; the step's new positions are queued layer by layer as
   the model finishes each layer (`on_layer`). `after_execute` waits until the writes have left
   this worker's memory, so blocks freed afterwards can be reused safely.
   Where the decode worker drafts with the same draft model as this worker (the lease names its
   draft blocks and the draft's hash), the draft computes the prompt too, after each step of the
   target, and its layers follow the target's in the same lease (`DraftKV`); a draft that cannot
   (no room, a failure) ships nothing more, and the decode worker computes the rest itself.
   A prompt that pauses between chunks for a more urgent one (the scheduler's) renews its lease
   every `RENEW_EVERY_S` while it waits: the decode worker waits for it rather than computing it
   itself (a prefill worker that stops stepping renews nothing, and the lease times out).
3. `on_finished`: a sampled first token -> NOTIFY; any other end -> ABORT to the decode worker
   (unless it was the decode worker that aborted). The prompt's blocks stay in the prefix cache.
4. A decode worker that aborts (naming the request and the lease's fence) or disconnects -> the
   request is aborted here, freeing its blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.role import RoleHooks
from pdserve.kv_transfer.api import KVSender, SenderFactory
from pdserve.kv_transfer.base import DraftKV, KVLayout, LayoutMismatch, Lease, ModelMismatch, TransferError, slot_runs
from pdserve.wire import PrefillLease

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.worker.tracing import WorkerTracing
    from pdserve.engine.step import SchedulerOutput

log = logging.getLogger("pdserve.worker.prefill")

MAX_SPARE_BLOCKS = 64  # blocks a lease's table may name past those of its sequence
RENEW_EVERY_S = 2.0  # how often a paused prompt's decode worker hears that it is still coming


@dataclass(slots=True)
class Shipment:
    sender: KVSender
    lease: Lease  # in the decode worker's numbering
    shipped: int  # positions below this were queued for every layer
    offers: dict  # how the decode worker is reached: a link lost before the first write is replaced
    kv_dtype: str
    peer_aborted: bool = False
    draft_shipped: int | None = None  # the draft model's positions queued below this; None: none to ship


class PrefillRole(RoleHooks):
    def __init__(self, senders: dict[str, SenderFactory], backends: list[str], token: str = "", name: str = "prefill") -> None:
        self.sender_types = senders  # backend name -> sender class
        self.backends = backends  # this worker's order of preference
        self.token = token
        self.name = name
        self.engine: LLMEngine | None = None
        self.layout: KVLayout | None = None
        self.draft_kv: DraftKV | None = None  # the engine's draft model's cache, where it drafts with one
        self.call: Callable[[Callable[[], None]], None] = lambda fn: fn()
        self.submit: Callable[[Callable[[], object]], Future] = _run_now
        self.shipments: dict[str, Shipment] = {}  # by engine request id
        self._late_layers: Callable[[int], None] | None = None  # the step's writer, for layers past the model's
        self._renewed_at = 0.0  # monotonic time paused prompts' leases were last renewed
        self._senders: dict[tuple, KVSender] = {}
        self._connect_lock = threading.Lock()
        self.num_notified = 0
        self.num_renewed = 0  # lease renewals sent for paused prompts
        self.tracing: WorkerTracing | None = None  # set by the worker where it traces requests

    def attach(self, engine: LLMEngine, layout: KVLayout, call, submit, draft_kv: DraftKV | None = None) -> None:
        self.engine, self.layout, self.call, self.submit = engine, layout, call, submit
        self.draft_kv = draft_kv

    # -- a lease arrives (HTTP thread) ---------------------------------------------------------

    def accept(self, body: PrefillLease) -> tuple[str, str, Future]:
        """Validate a lease and queue its prefill; returns (engine request id, backend used, and
        the engine's taking it: a prompt the engine refuses is refused to the decode worker)."""
        if body.model_hash != self.layout.model_hash:
            raise ModelMismatch("model mismatch: the decode worker serves another model (config hash differs)")
        tokens = body.prompt_token_ids
        resumed = body.output_token_ids  # a migrated request's tokens so far
        lease = lease_of(body, len(tokens) + len(resumed))
        start = lease.start
        params = body.sampling.first_token_params(len(resumed))
        sender, backend = self._sender_for(body.decode.as_dicts(), body.kv_transfer_dtype)
        sender.check(lease)  # an in-place writer: every block inside the decode worker's pool
        engine_id = f"{lease.request_id}@{lease.fence}"
        received = time.monotonic()  # its queue time starts now, not when the engine thread is free

        ours = self.draft_kv
        ships_draft = bool(lease.draft_block_table) and ours is not None and body.draft_hash == ours.layout.model_hash

        def add() -> None:
            self.engine.add_request(engine_id, {"prompt_token_ids": tokens}, params, output_token_ids=resumed,
                                    arrival_time=received)
            self.shipments[engine_id] = Shipment(sender, lease, start, body.decode.as_dicts(), body.kv_transfer_dtype,
                                                 draft_shipped=0 if ships_draft else None)
            if self.tracing is not None:
                layout = sender.layout
                self.tracing.begin_lease(engine_id, body.traceparent, received, backend, lease.end - start,
                                         layout.slot_bytes * layout.num_layers)

        sender.prepare(lease)
        return engine_id, backend, self.submit(add)

    def _sender_for(self, offers: dict, kv_dtype: str) -> tuple[KVSender, str]:
        encoding = "raw" if kv_dtype in ("auto", "", None) else kv_dtype
        errors = []
        for backend in self.backends:
            peer = offers.get(backend)
            if peer is None or backend not in self.sender_types:
                continue
            key = (backend, peer.get("host"), peer.get("port"), peer.get("path"), encoding)
            with self._connect_lock:
                sender = self._senders.get(key)
                if sender is not None and sender.alive:
                    return sender, backend
                try:
                    sender = self.sender_types[backend](
                        self.layout, self.engine.runner.kv_cache, peer, self.token, self.name, encoding,
                        on_peer_abort=self._on_peer_abort, draft=self.draft_kv)
                except LayoutMismatch:  # no other backend helps
                    raise
                except TransferError as e:
                    errors.append(f"{backend}: {e}")
                    continue
                self._senders[key] = sender
                return sender, backend
        raise TransferError("no KV transfer backend reaches the decode worker" + (f" ({'; '.join(errors)})" if errors else ""))

    def _on_peer_abort(self, request_id: str, fence: int | None) -> None:
        """A sender's thread: the decode worker aborted the lease (or was lost: no fence); end the
        prefill here."""
        self.call(lambda: self.abort(request_id, fence))

    def abort(self, request_id: str, fence: int | None) -> None:
        """The decode worker's abort of a lease, or of every lease of the request (engine thread)."""
        for engine_id, shipment in list(self.shipments.items()):
            if shipment.lease.request_id == request_id and fence in (None, shipment.lease.fence):
                shipment.peer_aborted = True
                self.engine.abort(engine_id)

    # -- engine hooks (engine thread) ----------------------------------------------------------

    def before_execute(self, step: SchedulerOutput) -> Callable[[int], None] | None:
        self._renew_paused(step)
        bs = self.engine.block_manager.block_size
        plan = []  # (shipment, start, end, source slot runs) computed in this step
        for req, n, table in zip(step.requests, step.num_new_tokens, step.block_tables):
            shipment = self.shipments.get(req.request_id)
            if shipment is None or not self._linked(req.request_id, shipment):
                continue
            lease = shipment.lease
            begin, end = req.num_computed_tokens, min(req.num_computed_tokens + n, lease.end)
            if shipment.shipped < begin:  # already in this worker's cache: send it all now
                runs = slot_runs(table, bs, shipment.shipped, begin)
                for layer in range(shipment.sender.layout.num_layers):  # the peer's pool layers
                    shipment.sender.write(lease, layer, shipment.shipped, begin, runs)
                shipment.shipped = begin
            begin = max(begin, lease.start)
            if begin < end:
                plan.append((shipment, begin, end, slot_runs(table, bs, begin, end)))
                shipment.shipped = max(shipment.shipped, end)
        if not plan:
            return None

        def on_layer(layer: int) -> None:  # a model layer: one pool layer per rank of the peer
            for shipment, begin, end, runs in plan:
                for pool_layer in shipment.sender.layout.pool_layers(layer):
                    shipment.sender.write(shipment.lease, pool_layer, begin, end, runs)
        self._late_layers = on_layer  # a draft head's layer: its KV is written after the model samples
        return on_layer

    def _renew_paused(self, step: SchedulerOutput) -> None:
        """Renew the leases of prompts that began and sit this step out (paused for a more urgent
        one), at most every `RENEW_EVERY_S`."""
        now = time.monotonic()
        if now - self._renewed_at < RENEW_EVERY_S or not self.shipments:
            return
        self._renewed_at = now
        stepping = {r.request_id for r in step.requests}
        requests = self.engine.scheduler.requests
        for engine_id, shipment in self.shipments.items():
            req = requests.get(engine_id)
            if engine_id not in stepping and req is not None and req.num_computed_tokens and shipment.sender.alive:
                shipment.sender.renew(shipment.lease)
                self.num_renewed += 1

    def _linked(self, engine_id: str, shipment: Shipment) -> bool:
        """Whether the shipment has a live link. One lost before anything was written for the lease
        (the lease waited in the queue while its link broke) is replaced by a new one, since the
        decode worker still waits for that KV; one lost later ends the prefill here (the decode
        worker lost that connection too, and recomputes). Engine thread."""
        if shipment.sender.alive:
            return True
        if shipment.shipped == shipment.lease.start and not shipment.peer_aborted:
            try:
                sender, _ = self._sender_for(shipment.offers, shipment.kv_dtype)
                sender.check(shipment.lease)
                sender.prepare(shipment.lease)
                shipment.sender = sender
                log.info("request %s: KV link lost before its first write; sent on a new link",
                         shipment.lease.request_id)
                return True
            except (TransferError, ValueError) as e:
                log.warning("request %s: KV link lost and not replaced: %s", shipment.lease.request_id, e)
                shipment.peer_aborted = True  # nothing reaches the decode worker: no ABORT to send
        self.call(lambda: self.engine.abort(engine_id))  # after this step, which has it scheduled
        return False

    def after_execute(self, step: SchedulerOutput) -> None:
        if self._late_layers is not None:
            model_layers = self.engine.model_config.num_layers  # the draft head's come after every rank's
            for layer in range(model_layers, model_layers + self.layout.num_layers - model_layers * self.layout.ranks):
                self._late_layers(layer)
            self._late_layers = None
        self._ship_draft(step)
        senders = {s.sender for r in step.requests if (s := self.shipments.get(r.request_id)) is not None}
        for sender in senders:
            try:
                sender.flush()
            except TransferError as e:
                log.warning("%s", e)
                sender.close()

    def _ship_draft(self, step: SchedulerOutput) -> None:
        """The draft model computes the positions the target computed in this step, for the
        requests whose decode worker takes its KV, and queues its layers' writes (engine thread).
        A draft that fails ships nothing more: the decode worker computes what it lacks."""
        draft = self.engine.draft_model
        wanted: list[tuple[Request, Shipment, int]] = []  # with the end of what the target computed
        for req, n in zip(step.requests, step.num_new_tokens):
            shipment = self.shipments.get(req.request_id)
            if shipment is not None and shipment.draft_shipped is not None and shipment.sender.alive:
                wanted.append((req, shipment, min(req.num_computed_tokens + n, shipment.lease.end)))
        if not wanted:
            return
        try:
            computed = draft.compute_prompts([(req.request_id, req.token_ids(0, end)) for req, _, end in wanted])
        except Exception:  # a bug in the draft must not end the prefill: the target's KV still goes
            log.exception("draft model prompt failed; its KV is left to the decode worker")
            computed = [None] * len(wanted)
        first, bs = self.layout.num_layers, draft.blocks.block_size
        for (req, shipment, _), done in zip(wanted, computed):
            if done is None:
                shipment.draft_shipped = None
                draft.drop(req.request_id)
                continue
            table, _, end = done
            begin = shipment.draft_shipped
            if begin < end:
                runs = slot_runs(table, bs, begin, end)
                for layer in range(self.draft_kv.layout.num_layers):
                    shipment.sender.write(shipment.lease, first + layer, begin, end, runs)
                shipment.draft_shipped = end

    def on_finished(self, request: Request) -> None:
        draft = self.engine.draft_model
        if draft is not None:
            draft.drop(request.request_id)
        shipment = self.shipments.pop(request.request_id, None)
        if shipment is None:
            return
        sender, lease = shipment.sender, shipment.lease
        sampled_here = len(request.output_token_ids) + request.num_prompt_tokens > lease.end
        if request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) and sampled_here:
            started = request.first_scheduled_time or request.arrival_time
            times = (started - request.arrival_time, (request.first_token_time or started) - started)
            logprobs = request.output_logprobs[-1] if request.output_logprobs else None
            feature = request.head_feature  # a draft head's, where this worker has one
            sender.notify(lease, request.output_token_ids[-1], times, logprobs, request.prompt_logprobs,
                          b"" if feature is None else feature.float().cpu().numpy().tobytes())
            self.num_notified += 1
        elif not shipment.peer_aborted:
            sender.abort(lease, f"prefill ended: {request.status.finish_reason}")
        sender.forget(lease)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()

    def cut_links(self) -> int:
        """Close every live link to a decode worker, as a network fault would (fault injection):
        what was pending on each fails as on a lost link, and the next lease connects again.
        Returns how many were closed."""
        with self._connect_lock:
            live = [s for s in self._senders.values() if s.alive]
        for sender in live:
            sender.close()
        return len(live)

    def stats(self) -> dict:
        return {
            "kv_shipments": len(self.shipments),
            "kv_notified": self.num_notified,
            "kv_bytes_sent": sum(s.bytes_sent for s in self._senders.values()),
            "kv_peers": sum(1 for s in self._senders.values() if s.alive),
        }


def _run_now(fn: Callable[[], object]) -> Future:
    """`submit` before a worker attaches its engine thread: run on the caller's thread."""
    future: Future = Future()
    try:
        future.set_result(fn())
    except Exception as e:  # handed to the caller
        future.set_exception(e)
    return future


def lease_of(body: PrefillLease, end: int) -> Lease:
    """The lease in a decode worker's /v1/prefill body, for a sequence of `end` tokens; ValueError
    unless it is one that decode worker could have made (the message's own bounds held already)."""
    fence, start, block_size, table = body.fence, body.start, body.block_size, body.block_table
    if not 0 <= start < end:
        raise ValueError(f"lease start {start} outside the sequence of {end} tokens")
    if block_size & (block_size - 1):
        raise ValueError(f"lease block_size {block_size} is not a power of two")
    needed = -(-end // block_size)
    for name, blocks in (("block_table", table), ("draft_block_table", body.draft_block_table)):
        if blocks is body.draft_block_table and not blocks:
            continue  # the decode worker takes no draft KV
        if not needed <= len(blocks) <= needed + MAX_SPARE_BLOCKS:
            raise ValueError(f"lease {name} has {len(blocks)} blocks; a sequence of {end} tokens in blocks of "
                             f"{block_size} needs {needed} (at most {MAX_SPARE_BLOCKS} more)")
    return Lease(body.request_id, fence, list(table), block_size, start, end, 0.0,
                 draft_block_table=list(body.draft_block_table))
