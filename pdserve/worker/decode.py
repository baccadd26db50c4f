"""The decode role: reserve blocks, lease them to a prefill worker, admit the request once its KV
landed, and recompute the prompt here whenever the transfer does not come through.

Lifecycle of a request with a prefill worker, on the decode worker:
1. `generate(..., prefill_url=...)`: the request waits for admission in the scheduler's queue.
2. Admission reserves blocks for its prompt (minus this worker's own prefix-cache hit) plus
   headroom -> WAITING_FOR_KV -> `on_reserved`: a lease with a new fence opens in the receiver and
   the prefill worker is asked, off the engine thread, to fill it. Fences are random (62 bits),
   unique among this worker's leases and lease holders: a peer cannot end or write another
   request's lease by guessing its fence.
3. LANDED -> `engine.kv_landed`: RUNNING, with the prefill worker's first token.
4. FAILED (prefill aborted, was lost, or notified early), a refused prefill request, or the lease
   timing out -> the blocks move to a holder `lease-<fence>` until the receiver says RELEASABLE,
   and the request recomputes its prompt here (the colocated path).
5. Abort while WAITING_FOR_KV: the same hand-over; the lease closes and the prefill worker is told.
6. Every turn of the engine loop (`poll`): receiver events, timed-out leases, and peers cut off
   that left a closed lease pinned past the receiver's grace period (its RELEASABLE follows).
"""

from __future__ import annotations

import logging
import queue
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import httpx
import msgspec

from pdserve import wire

from pdserve.engine.request import Request
from pdserve.engine.role import RoleHooks
from pdserve.kv_transfer.base import DraftKV, Lease
from pdserve.kv_transfer.leases import EventKind, ReceiverEvent
from pdserve.kv_transfer.receiver import KVReceiver

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.worker.tracing import WorkerTracing

log = logging.getLogger("pdserve.worker.decode")


def holder_id(fence: int) -> str:
    return f"lease-{fence}"


class DecodeRole(RoleHooks):
    def __init__(self, lease_timeout_s: float = 30.0, token: str = "", kv_transfer_dtype: str = "auto") -> None:
        self.lease_timeout_s = lease_timeout_s
        self.token = token
        self.kv_transfer_dtype = kv_transfer_dtype
        self.engine: LLMEngine | None = None
        self.receiver: KVReceiver | None = None
        self.draft_kv: DraftKV | None = None  # the draft model's cache, where the engine drafts with one
        self.offers: dict[str, dict] = {}  # backend -> how a prefill worker reaches this one
        # request id -> (prefill worker URL, the request's sampling as it came), until its lease is open
        self.targets: dict[str, tuple[str, wire.Sampling]] = {}
        self.leases: dict[str, Lease] = {}  # live leases by request id
        self._prefill_urls: dict[int, str] = {}  # fence -> the prefill worker filling it
        self._fences: set[int] = set()  # of live leases and of lease holders not yet released
        self._http = httpx.Client(timeout=httpx.Timeout(10.0, read=30.0))
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="prefill-dispatch")
        self.num_landed = 0
        self.num_recomputed = 0
        self.call = lambda fn: fn()  # set by the worker: run on the engine thread
        self.tracing: WorkerTracing | None = None  # set by the worker where it traces requests

    def attach(self, engine: LLMEngine, receiver: KVReceiver, offers: dict[str, dict], call) -> None:
        self.engine, self.receiver, self.offers, self.call = engine, receiver, offers, call
        self.draft_kv = receiver.draft

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    # -- scheduler hooks (engine thread) -------------------------------------------------------

    def on_reserved(self, request: Request) -> None:
        url, sampling = self.targets.pop(request.request_id)
        lease = Lease(
            request.request_id, self._new_fence(), list(self.engine.block_manager.block_table(request.request_id)),
            self.engine.block_manager.block_size, request.num_computed_tokens, request.num_tokens,
            time.monotonic() + self.lease_timeout_s, self.lease_timeout_s,
        )
        draft = self.engine.draft_model
        if draft is not None and request.params.speculate and not self.engine.scheduler.draft_budget.sitting_out:
            # its draft's KV comes in the same lease (not while drafting does not pay here: a
            # probe that finds it pays again computes what the draft lacks)
            lease.draft_block_table = draft.reserve(request.request_id, request.num_tokens) or []
        self.leases[request.request_id] = lease
        self.receiver.open_lease(lease)
        body = wire.PrefillLease(
            request_id=request.request_id,
            fence=lease.fence,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,  # a resumed request's tokens so far
            sampling=sampling,
            start=lease.start,
            block_table=lease.block_table,
            block_size=lease.block_size,
            model_hash=self.receiver.layout.model_hash,
            kv_transfer_dtype=self.kv_transfer_dtype,
            decode=msgspec.convert(self.offers, wire.DecodeOffers),
            draft_block_table=lease.draft_block_table,
            draft_hash=self.draft_kv.layout.model_hash if lease.draft_block_table else "",
            traceparent=self.tracing.traceparent(request.request_id) if self.tracing is not None else "",
        )
        self._prefill_urls[lease.fence] = url
        self._pool.submit(self._dispatch, url, body, lease.fence)

    def _new_fence(self) -> int:
        while True:
            fence = secrets.randbits(62)
            if fence and fence not in self._fences:
                self._fences.add(fence)
                return fence

    def on_finished(self, request: Request) -> None:
        self.targets.pop(request.request_id, None)
        lease = self.leases.pop(request.request_id, None)
        if lease is not None:  # aborted while its KV was on the way
            self._end_lease(lease, "request aborted")

    # -- transfer events and timers (engine thread) --------------------------------------------

    def poll(self) -> None:
        while True:
            try:
                event: ReceiverEvent = self.receiver.events.get_nowait()
            except queue.Empty:
                break
            self._on_event(event)
        now = time.monotonic()
        for lease in self.receiver.expired(now):
            self._fall_back(lease.request_id, lease.fence, "KV transfer timed out")
        self.receiver.reclaim(now)

    def _on_event(self, event: ReceiverEvent) -> None:
        if event.kind == EventKind.RELEASABLE:
            self._release(event.fence)
            return
        lease = self.leases.get(event.request_id)
        if lease is None or lease.fence != event.fence:
            return  # a lease that already ended here
        if event.kind == EventKind.LANDED and 0 <= event.first_token < self.engine.model_config.vocab_size:
            lease = self.leases.pop(event.request_id)  # first: a first token that ends it finishes it
            self._draft_landed(lease)
            try:
                self.engine.kv_landed(event.request_id, event.first_token, event.prefill_times, event.first_logprobs,
                                      event.prompt_logprobs, event.feature)
            except ValueError as e:  # what the request needs did not come with its first token
                self.leases[event.request_id] = lease  # nothing changed: the lease ends as any failed one
                self._fall_back(event.request_id, event.fence, str(e))
                return
            self._prefill_urls.pop(event.fence, None)
            self._fences.discard(event.fence)  # the blocks stay with the request: no holder
            self.num_landed += 1
        elif event.kind == EventKind.LANDED:  # the peer's token would index past the embedding table
            self._fall_back(event.request_id, event.fence, f"prefill worker sent token {event.first_token}")
        else:
            self._fall_back(event.request_id, event.fence, event.reason)

    def _fall_back(self, request_id: str, fence: int, reason: str) -> None:
        lease = self.leases.get(request_id)
        if lease is None or lease.fence != fence:
            return
        log.warning("request %s: %s; recomputing its prompt here", request_id, reason)
        if self.tracing is not None:
            self.tracing.fallback(request_id, reason)
        del self.leases[request_id]
        self._end_lease(lease, reason)
        self.num_recomputed += 1
        self.engine.kv_failed(request_id)

    def _draft_landed(self, lease: Lease) -> None:
        """The draft model's KV came with the target's, or the draft computes it here: the lease
        is gone, so no write reaches its blocks any more."""
        draft = self.engine.draft_model
        if draft is None or not lease.draft_block_table:
            return
        request = self.engine.scheduler.waiting_for_kv.get(lease.request_id)
        if request is not None and lease.draft_complete:
            draft.adopt(request, lease.end)
        else:
            draft.drop(lease.request_id)

    def _end_lease(self, lease: Lease, reason: str) -> None:
        """The request gives its blocks to a holder, freed once no write can reach them."""
        self.engine.block_manager.hand_over(lease.request_id, holder_id(lease.fence))
        if lease.draft_block_table:
            self.engine.draft_model.hand_over(lease.request_id, holder_id(lease.fence))
        if not self.receiver.close_lease(lease.fence, reason):
            self._release(lease.fence)  # landed in full, or already released: nothing writes any more
        url = self._prefill_urls.pop(lease.fence, None)
        if url is not None:
            self._pool.submit(self._post, url, "/v1/prefill/abort",
                              wire.AbortRequest(request_id=lease.request_id, fence=lease.fence))

    def _release(self, fence: int) -> None:
        self.engine.block_manager.release(holder_id(fence))
        if self.engine.draft_model is not None:
            self.engine.draft_model.release_holder(holder_id(fence))
        self._fences.discard(fence)

    # -- the prefill worker, off the engine thread ---------------------------------------------

    def _dispatch(self, url: str, body: wire.PrefillLease, fence: int) -> None:
        try:
            r = self._post(url, "/v1/prefill", body)
            if r is not None and r.status_code == 200:
                return
            reason = f"prefill worker refused: {_error_message(r)}" if r is not None else "prefill worker unreachable"
        except Exception as e:  # any failure here ends in recomputation, never a lost request
            reason = f"prefill dispatch failed: {e}"
        self._prefill_urls.pop(fence, None)
        self.call(lambda: self._fall_back(body.request_id, fence, reason))

    def _post(self, url: str, path: str, body: msgspec.Struct) -> httpx.Response | None:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            return self._http.post(url.rstrip("/") + path, content=wire.encode(body), headers=headers)
        except httpx.HTTPError as e:
            log.warning("POST %s%s failed: %s", url, path, e)
            return None

    def stats(self) -> dict:
        rx = self.receiver
        return {
            "kv_leases_open": len(self.leases),
            "kv_landed": self.num_landed,
            "kv_recomputed": self.num_recomputed,
            "kv_stale_writes": rx.num_stale_writes if rx else 0,
            "kv_bytes_received": rx.bytes_received if rx else 0,
            "kv_refused_connections": rx.num_refused_connections if rx else 0,
            "kv_forced_disconnects": rx.num_forced_disconnects if rx else 0,
            "kv_lease_renewals": rx.leases.num_renewals if rx else 0,
        }


def _error_message(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except Exception:
        return f"HTTP {r.status_code}"

