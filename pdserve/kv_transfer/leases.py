"""The decode worker's leases and every transition they make, in one place (thread-safe).

Lifecycle of a lease:
1. `open` (engine thread): the request's reserved blocks may now be written under its fence.
2. A peer WRITEs layers of position ranges (`begin_write` / `end_write` around each payload), or
   CLAIMs the lease (`claim`): that binds it to a peer that writes in place (shared memory, NIXL)
   and then only reports its "direct" WRITEs. Once a peer wrote or claimed a lease, no other peer
   may touch it.
3. NOTIFY with the first token (`notify`): if every layer is complete, the lease ends and LANDED
   is emitted; otherwise FAILED.
4. Any other end (peer ABORT, peer lost, `close` on abort or timeout) emits FAILED for a live
   lease, and RELEASABLE once no write can touch its blocks any more: at once for receiver-written
   leases with no write in flight, after the in-place writer acknowledged the abort, or when that
   peer's connection is gone. A peer that leaves a closed lease pinned past the grace period is
   cut off (`reclaim`), which releases it.
Every frame from a peer names its lease by request id and fence, and both must match (and the
peer must be the one bound to it, if any); anything else is stale and changes nothing.

The peer threads' half is called by whatever carries a peer's frames: a socket connection
(receiver.py), or the in-process backend of tests (memory.py), which hands over the same headers.
"""

from __future__ import annotations

import enum
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from pdserve.kv_transfer.base import Lease
from pdserve.kv_transfer.codec import AbortHeader, FrameError, Header, NotifyHeader, StaleWrite, WriteHeader
from pdserve.outputs import TokenLogprobs


class EventKind(enum.IntEnum):
    FAILED = 1  # the lease ended without the KV: recompute the prompt
    LANDED = 2  # all KV is in the blocks; first_token is set
    RELEASABLE = 3  # no write can reach the lease's blocks any more


@dataclass(slots=True, frozen=True)
class ReceiverEvent:
    kind: EventKind
    request_id: str
    fence: int
    first_token: int = -1
    reason: str = ""
    prefill_times: tuple[float, float] = (0.0, 0.0)  # LANDED: queue and compute seconds on the prefill worker
    first_logprobs: TokenLogprobs | None = None  # LANDED, where the request asked for log-probabilities
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # LANDED, where it asked for its prompt's
    feature: bytes = b""  # LANDED, where the prefill worker drafts with a draft head: its feature at the last token


class Peer(Protocol):
    """A prefill peer's connection, as the leases see it."""

    def send(self, header: Header) -> None: ...

    def drop(self) -> bool:
        """Cut the connection (its reader then calls `disconnect`); True the first time."""
        ...


class LeaseState:
    """One lease and what is bound to it; changed only by the table, under its lock."""

    __slots__ = ("lease", "peer", "direct", "inflight", "closed_at", "released")

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.peer: Peer | None = None  # the peer writing it, once one did
        self.direct = False  # that peer writes in place
        self.inflight = 0  # WRITE payloads being received into its blocks right now
        self.closed_at: float | None = None  # monotonic time it stopped taking writes
        self.released = False

    @property
    def closed(self) -> bool:
        return self.closed_at is not None

    @property
    def releasable(self) -> bool:
        # An in-place writer may still be copying until it acknowledged the abort.
        return self.closed and self.inflight == 0 and not (self.direct and self.peer is not None)


class LeaseTable:
    def __init__(self, events: queue.Queue, release_grace_s: float) -> None:
        self.events = events
        self.release_grace_s = release_grace_s
        self._lock = threading.Lock()
        self._leases: dict[int, LeaseState] = {}  # by fence
        self.num_forced_disconnects = 0  # peers cut off for leaving a closed lease pinned
        self.num_stale_writes = 0  # WRITEs refused for naming no live lease of the peer's
        self.bytes_received = 0  # KV bytes that landed: received into blocks, or reported written in place
        self.num_renewals = 0  # leases kept waiting by a peer whose prompt was paused

    # -- engine thread -------------------------------------------------------------------------

    def open(self, lease: Lease, num_layers: int, num_draft_layers: int = 0) -> None:
        lease.received = [lease.start] * num_layers  # per layer: high-water position
        lease.draft_received = [0] * num_draft_layers if lease.draft_block_table else []
        with self._lock:
            assert lease.fence not in self._leases, f"fence {lease.fence} reused"
            self._leases[lease.fence] = LeaseState(lease)

    def close(self, fence: int, reason: str) -> bool:
        """End a lease that has not landed (abort, timeout); idempotent. True if RELEASABLE is
        yet to come for it; False if the lease is gone (landed or already released)."""
        with self._lock:
            state = self._leases.get(fence)
            if state is None:
                return False
            if state.closed:
                return True
            state.closed_at = time.monotonic()
            peer = state.peer
            ready = state.releasable
        if peer is not None:
            peer.send(AbortHeader(state.lease.request_id, fence, reason))
        if ready:
            self._release(state)
        return True

    @property
    def num_open(self) -> int:
        with self._lock:
            return sum(1 for s in self._leases.values() if not s.closed)

    def expired(self, now: float) -> list[Lease]:
        with self._lock:
            return [s.lease for s in self._leases.values() if not s.closed and s.lease.deadline < now]

    def reclaim(self, now: float) -> int:
        """Cut off every peer still bound to a lease closed more than the grace period ago (an
        in-place writer that never acknowledged the abort, a payload stuck mid-frame): losing the
        peer releases each of its leases. Returns how many peers were cut off."""
        with self._lock:
            stuck = {s.peer for s in self._leases.values()
                     if s.peer is not None and s.closed and now - s.closed_at > self.release_grace_s}
        dropped = sum(1 for peer in stuck if peer.drop())
        self.num_forced_disconnects += dropped
        return dropped

    # -- peer threads --------------------------------------------------------------------------

    def claim(self, request_id: str, fence: int, peer: Peer) -> str:
        """Bind the lease to an in-place writer; returns why not ("" when bound)."""
        with self._lock:
            try:
                state = self._live(request_id, fence, peer)
            except StaleWrite as e:
                return str(e)
            state.peer, state.direct = peer, True
            return ""

    def begin_write(self, h: WriteHeader, peer: Peer) -> LeaseState:
        """A WRITE whose header the caller checked against the layout is about to land: StaleWrite
        for no such live lease, FrameError for positions the lease does not hold."""
        layers = range(h.layer, h.layer + h.num_layers)
        with self._lock:
            try:
                state = self._live(h.request_id, h.fence, peer)
            except StaleWrite:
                self.num_stale_writes += 1
                raise
            lease = state.lease
            marks, first = _marks(lease, layers)
            low = 0 if marks is lease.draft_received else lease.start
            if not all(low <= h.start <= marks[first + k] for k in range(len(layers))) or h.start + h.num_tokens > lease.end:
                raise FrameError(f"positions [{h.start}, {h.start + h.num_tokens}) outside lease {lease.fence}")
            if h.encoding == "direct" and not state.direct:
                raise FrameError("direct WRITE on an unclaimed lease")
            state.peer = peer
            state.inflight += 1
            return state

    def renew(self, request_id: str, fence: int, peer: Peer) -> None:
        """The peer computes the lease's prompt still (paused for a more urgent one): its deadline
        moves to its timeout from now. StaleWrite for no such live lease of this peer's."""
        with self._lock:
            state = self._live(request_id, fence, peer)
            lease = state.lease
            lease.deadline = max(lease.deadline, time.monotonic() + lease.timeout_s)
            self.num_renewals += 1

    def end_write(self, state: LeaseState, layers: range, end: int, num_bytes: int) -> None:
        """The WRITE `begin_write` let through has landed: `num_bytes` of these layers' KV, up to
        position `end`."""
        with self._lock:
            self.bytes_received += num_bytes
            state.inflight -= 1
            marks, first = _marks(state.lease, layers)
            for k in range(first, first + len(layers)):
                marks[k] = max(marks[k], end)
            ready = state.releasable
        if ready:
            self._release(state)

    def notify(self, h: NotifyHeader, peer: Peer) -> None:
        with self._lock:
            state = self._leases.get(h.fence)
            if state is None or state.closed or state.peer not in (None, peer) or state.lease.request_id != h.request_id:
                return  # a late notify for a lease already ended, or not this peer's: nothing to do
            lease = state.lease
            if not (lease.complete and state.inflight == 0):
                reason = "notified before all KV landed"
            elif h.num_prompt_tokens != lease.end or h.first_token < 0:
                reason = f"bad notify: token {h.first_token} after {h.num_prompt_tokens} tokens, lease holds {lease.end}"
            else:
                try:
                    first_logprobs, prompt_logprobs = h.logprobs(), h.prompt_logprobs()
                    reason = ""
                except ValueError as e:
                    reason = f"bad notify: {e}"
            state.closed_at = time.monotonic()
            if not reason:
                state.released = True  # the blocks stay with the request
                del self._leases[h.fence]
        if not reason:
            times = tuple(t if math.isfinite(t) and t >= 0 else 0.0 for t in (h.prefill_queue_s, h.prefill_compute_s))
            self.events.put(ReceiverEvent(EventKind.LANDED, h.request_id, h.fence, first_token=h.first_token,
                                          prefill_times=times, first_logprobs=first_logprobs,
                                          prompt_logprobs=prompt_logprobs, feature=h.feature))
        else:
            self.events.put(ReceiverEvent(EventKind.FAILED, h.request_id, h.fence, reason=reason))
            self._unbind(state)

    def peer_stopped(self, request_id: str, fence: int, peer: Peer, reason: str = "") -> None:
        """The peer will not write this lease again: it aborted (`reason` given), or it
        acknowledged our abort of a closed lease."""
        with self._lock:
            state = self._leases.get(fence)
            if state is None or state.lease.request_id != request_id or state.peer not in (None, peer):
                return
            if not reason and not state.closed:
                return  # an acknowledgement of nothing
        if reason:
            self._fail(state, reason)
        self._unbind(state)

    def disconnect(self, peer: Peer) -> None:
        """The peer's connection is gone, and with it its reader: nothing of it writes any more."""
        with self._lock:
            bound = [s for s in self._leases.values() if s.peer is peer]
        for state in bound:
            self._fail(state, "prefill peer disconnected")
            with self._lock:
                state.peer = None
                state.inflight = 0  # this connection's reader, the only one writing it, has ended
            self._release(state)

    # -- transitions (any thread) --------------------------------------------------------------

    def _live(self, request_id: str, fence: int, peer: Peer) -> LeaseState:
        """Called under the lock."""
        state = self._leases.get(fence)
        if state is None or state.closed or state.lease.request_id != request_id:
            raise StaleWrite(f"no open lease {fence} for request {request_id!r}")
        if state.peer is not None and state.peer is not peer:
            raise StaleWrite(f"lease {fence} is bound to another peer")
        return state

    def _unbind(self, state: LeaseState) -> None:
        with self._lock:
            state.peer = None  # it will not write again: no acknowledgement to wait for
            ready = state.releasable
        if ready:
            self._release(state)

    def _release(self, state: LeaseState) -> None:
        with self._lock:
            if state.released:
                return
            state.released = True
            self._leases.pop(state.lease.fence, None)
        self.events.put(ReceiverEvent(EventKind.RELEASABLE, state.lease.request_id, state.lease.fence))

    def _fail(self, state: LeaseState, reason: str) -> None:
        """The peer ended a live lease: decode recomputes."""
        with self._lock:
            if state.closed:
                return
            state.closed_at = time.monotonic()
        self.events.put(ReceiverEvent(EventKind.FAILED, state.lease.request_id, state.lease.fence, reason=reason))


def _marks(lease: Lease, layers: range) -> tuple[list[int], int]:
    """The high-water marks these layers advance (the target's, or the draft model's, whose layers
    follow the target's on the wire) and the index of the first; FrameError for layers of both,
    or past what the lease holds."""
    n = len(lease.received)
    marks, first = (lease.received, layers.start) if layers.start < n else (lease.draft_received, layers.start - n)
    if layers.start < n < layers.stop or first + len(layers) > len(marks):
        raise FrameError(f"layers [{layers.start}, {layers.stop}) outside lease {lease.fence}")
    return marks, first
