"""The in-process backend, for tests: a prefill and a decode worker in one process, no socket.

The decode side publishes its cache and its lease table under a name (`publish`, offered as
`{"pid", "endpoint"}`); a `MemorySender` looks the name up and writes each layer straight into
the leased blocks, handing the lease table the very frames a socket peer would send (CLAIM on
`prepare`, a "direct" WRITE around each copy, NOTIFY, ABORT, and ACK of the decode worker's
aborts). So fences, claims, aborts, expiry and the release of blocks run through the same state
machine as over tcp or shared memory, synchronously, on the callers' threads.

Never a fallback: a worker uses it only with "memory" in its transfer list; an offer from another
process is refused (the name means nothing there).
"""

from __future__ import annotations

import hmac
import os
import secrets
import threading
from dataclasses import dataclass, field

import torch

from pdserve.kv_transfer.api import PeerAbort
from pdserve.kv_transfer.base import (
    DraftKV, KVLayout, LayoutMismatch, Lease, TransferError, TransferStatus, split_layout,
)
from pdserve.kv_transfer.codec import AbortHeader, FrameError, Header, NotifyHeader, StaleWrite, WriteHeader
from pdserve.kv_transfer.leases import LeaseTable
from pdserve.kv_transfer.quant import dequantize_into, encoded_size, gather_slots, gather_split, quantize
from pdserve.outputs import TokenLogprobs


@dataclass(slots=True, eq=False)
class MemoryEndpoint:
    """A decode worker's cache and leases, as the senders in its process reach them."""

    layout: KVLayout
    kv_cache: torch.Tensor  # [layers, slots, 2, kv_heads, head_dim]
    leases: LeaseTable
    token: str
    draft: DraftKV | None = None  # a draft model's cache, where the decode worker drafts with one
    senders: set[MemorySender] = field(default_factory=set)  # connected, cut off on `withdraw`


_endpoints: dict[str, MemoryEndpoint] = {}
_endpoints_lock = threading.Lock()


def publish(layout: KVLayout, kv_cache: torch.Tensor, leases: LeaseTable, token: str = "",
            draft: DraftKV | None = None) -> dict:
    """Make the cache reachable by senders in this process; returns what the offer adds."""
    name = secrets.token_hex(8)
    with _endpoints_lock:
        _endpoints[name] = MemoryEndpoint(layout, kv_cache, leases, token, draft)
    return {"pid": os.getpid(), "endpoint": name}


def withdraw(kv_cache: torch.Tensor) -> None:
    """Unpublish the cache and cut off its senders, as closing a receiver cuts its connections."""
    with _endpoints_lock:
        gone = [name for name, e in _endpoints.items() if e.kv_cache is kv_cache]
        endpoints = [_endpoints.pop(name) for name in gone]
    for endpoint in endpoints:
        for sender in list(endpoint.senders):
            sender.close()


def _endpoint(offer: dict) -> MemoryEndpoint:
    pid, name = offer.get("pid"), offer.get("endpoint")
    if pid != os.getpid():
        raise TransferError(f"the memory backend works within one process; this offer comes from process {pid!r}")
    with _endpoints_lock:
        endpoint = _endpoints.get(name) if isinstance(name, str) else None
    if endpoint is None:
        raise TransferError(f"no KV endpoint {name!r} in this process")
    return endpoint


class MemorySender:
    """A `KVSender` that is also the lease table's `Peer`: the table sends it aborts and may cut it
    off (`drop`), as it would a socket connection."""

    backend = "memory"

    def __init__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,
        peer: dict,
        token: str = "",
        name: str = "prefill",
        encoding: str = "raw",
        on_peer_abort: PeerAbort = lambda request_id, fence: None,
        draft: DraftKV | None = None,
    ) -> None:
        endpoint = _endpoint(peer)
        if not hmac.compare_digest(token.encode(), endpoint.token.encode()):
            raise TransferError("the decode worker refused the KV connection: bad token")
        own, layout = layout, split_layout(layout, peer, draft)  # the peer's pool layers are written
        try:
            endpoint.layout.check_compatible(layout)
        except LayoutMismatch as e:
            raise type(e)(f"the decode worker refused the KV connection: {e}") from None
        encoded_size(layout, 1, encoding)  # ValueError for an unknown encoding
        self.own_layout = own
        self.layout, self.kv_cache, self.encoding, self.on_peer_abort = layout, kv_cache, encoding, on_peer_abort
        self.draft = draft
        self.leases = endpoint.leases
        self._endpoint = endpoint
        self._lock = threading.Lock()
        self._status: dict[str, TransferStatus] = {}
        self._aborted_fences: set[int] = set()
        self._claimed: dict[int, bool] = {}  # fence -> whether the table bound the lease to this sender
        self._closed = False
        self.bytes_sent = 0
        with _endpoints_lock:
            endpoint.senders.add(self)

    # -- the KVSender interface (engine thread) ------------------------------------------------

    def check(self, lease: Lease) -> None:
        """Nothing to refuse: the copies land where the decode worker's own lease says."""

    def prepare(self, lease: Lease) -> None:
        if self._usable(lease):
            self._claim(lease)

    def write(self, lease: Lease, layer: int, start: int, end: int, src_runs: list[tuple[int, int]]) -> None:
        with self._lock:
            self._status.setdefault(lease.request_id, TransferStatus.PENDING)
        if not self._usable(lease, TransferStatus.FAILED) or not self._claim(lease):
            return
        encoding = "direct" if layer < self.layout.num_layers else "raw"  # a draft model's KV: as a frame's
        header = WriteHeader(lease.request_id, lease.fence, layer, start, end - start, encoding, 1)
        try:
            state = self.leases.begin_write(header, self)
        except StaleWrite:
            return  # counted by the table; the link goes on, as over a socket
        except FrameError:
            self.close()  # a receiver drops a connection over such a write
            return
        try:
            landed = self._copy(state.lease, layer, start, end, src_runs)
        except BaseException:
            self.close()  # like a connection lost mid-payload: the table resets what was in flight
            raise
        self.bytes_sent += landed
        self.leases.end_write(state, range(layer, layer + 1), end, landed)

    def notify(self, lease: Lease, first_token: int, times: tuple[float, float] = (0.0, 0.0),
               logprobs: TokenLogprobs | None = None,
               prompt_logprobs: list[TokenLogprobs | None] | None = None, feature: bytes = b"") -> None:
        if not self._usable(lease, TransferStatus.FAILED):
            return
        self.leases.notify(NotifyHeader.of(lease, first_token, times, logprobs, prompt_logprobs, feature), self)
        with self._lock:
            self._status[lease.request_id] = TransferStatus.DONE

    def abort(self, lease: Lease, reason: str) -> None:
        if not self._usable(lease):
            return
        with self._lock:
            self._aborted_fences.add(lease.fence)
            self._status[lease.request_id] = TransferStatus.ABORTED
        self.leases.peer_stopped(lease.request_id, lease.fence, self, f"prefill aborted: {reason}")

    def renew(self, lease: Lease) -> None:
        if self._usable(lease):
            try:
                self.leases.renew(lease.request_id, lease.fence, self)
            except StaleWrite:
                pass

    def forget(self, lease: Lease) -> None:
        with self._lock:
            self._status.pop(lease.request_id, None)
            self._aborted_fences.discard(lease.fence)
            self._claimed.pop(lease.fence, None)

    def poll(self, request_id: str) -> TransferStatus:
        with self._lock:
            return self._status.get(request_id, TransferStatus.PENDING)

    def flush(self, timeout: float = 60.0) -> None:
        """Every write landed before it returned: nothing still reads the source memory."""

    @property
    def alive(self) -> bool:
        return not self._closed

    def close(self) -> None:
        self._lose()

    # -- the lease table's Peer (decode threads) -----------------------------------------------

    def send(self, header: Header) -> None:
        """The decode worker aborted a lease: stop it here, report it, and acknowledge at once
        (a copy still in flight is counted by the table, which waits for it)."""
        if not isinstance(header, AbortHeader):
            return
        with self._lock:
            self._aborted_fences.add(header.fence)
            if self._status.get(header.request_id) == TransferStatus.PENDING:
                self._status[header.request_id] = TransferStatus.ABORTED
        self.on_peer_abort(header.request_id, header.fence)
        self.leases.peer_stopped(header.request_id, header.fence, self)

    def drop(self) -> bool:
        return self._lose()

    # -- helpers -------------------------------------------------------------------------------

    def _lose(self) -> bool:
        """Like a lost link: every pending request fails here (reported with no fence), and every
        lease bound to this sender fails and is released on the decode side. True the first time."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            pending = [r for r, s in self._status.items() if s == TransferStatus.PENDING]
            for request_id in pending:
                self._status[request_id] = TransferStatus.FAILED
        with _endpoints_lock:
            self._endpoint.senders.discard(self)
        for request_id in pending:
            self.on_peer_abort(request_id, None)
        self.leases.disconnect(self)
        return True

    def _usable(self, lease: Lease, if_closed: TransferStatus | None = None) -> bool:
        """Whether calls for the lease still reach the peer: not after `close`, where the request
        gets `if_closed` (as a queued job does on a closed socket sender), nor after an abort."""
        with self._lock:
            if self._closed and if_closed is not None:
                self._status[lease.request_id] = if_closed
            return not self._closed and lease.fence not in self._aborted_fences

    def _claim(self, lease: Lease) -> bool:
        with self._lock:
            known = self._claimed.get(lease.fence)
        if known is not None:
            return known
        ok = not self.leases.claim(lease.request_id, lease.fence, self)
        with self._lock:
            self._claimed[lease.fence] = ok
            if not ok:
                self._aborted_fences.add(lease.fence)
        return ok

    def _copy(self, lease: Lease, layer: int, start: int, end: int, src_runs: list[tuple[int, int]]) -> int:
        """This side's slot runs of one layer into the blocks the decode worker's lease names;
        quantized and back with an 8-bit encoding, as a tcp transfer would (a draft model's layers,
        numbered after the target's, raw into the decode worker's draft cache). Returns bytes."""
        layout, src, dst, encoding, draft = self.layout, self.kv_cache, self._endpoint.kv_cache, self.encoding, False
        if layer >= self.layout.num_layers:
            ours, theirs = self.draft, self._endpoint.draft
            if ours is None or theirs is None or ours.layout != theirs.layout:
                raise TransferError("draft model KV for a worker that drafts with another model, or none")
            layout, src, dst, encoding, draft = ours.layout, ours.cache, theirs.cache, "raw", True
            layer -= self.layout.num_layers
        dst_runs = lease.slot_runs(start, end, draft)
        if draft:
            kv = gather_slots(src, layer, src_runs)  # [tokens, 2, kv_heads, head_dim]
        else:  # as the peer's pool layer holds it
            kv = gather_split(src, self.own_layout.ranks, layout.ranks, layer, src_runs)
        if encoding == "raw":
            offset = 0
            for slot, n in dst_runs:
                dst[layer, slot : slot + n].copy_(kv[offset : offset + n])
                offset += n
        else:
            data = torch.frombuffer(bytearray(quantize(kv, encoding)), dtype=torch.uint8)
            dequantize_into(dst, layer, dst_runs, data, layout, encoding)
        return encoded_size(layout, end - start, encoding)
