"""The decode side of KV transfer: the listening socket, and what prefill peers send on it.

Lifecycle of a connection from a prefill peer:
1. The listener accepts it (at most `PeerLimits.max_connections` at once) and a reader thread
   takes it; the HELLO frame (token and KV layout, checked) must be complete within
   `PeerLimits.hello_timeout_s` of the accept, and is answered with an ACK or a refusal.
2. Frames follow, in any number, with idle time between them allowed: a tcp WRITE lands straight
   in the leased blocks, a CLAIM binds a lease to an in-place writer, NOTIFY ends a lease, ABORT
   and ACK end a peer's part in one. What each does to a lease is decided by the `LeaseTable`
   (leases.py), which emits the events (`EventKind`, `ReceiverEvent`) the decode worker consumes.
3. A malformed or oversized frame, a frame stalled past `FrameLimits.frame_timeout_s`, a dead
   peer, or `reclaim` cutting off a peer that pins a closed lease: the connection is dropped, and
   every lease bound to it fails and is released.
Writes with an unknown, closed or mismatched fence are dropped (`StaleWrite`), never written.
"""

from __future__ import annotations

import hmac
import logging
import queue
import socket
import threading

import torch

from pdserve.kv_transfer.base import DraftKV, KVLayout, Lease, TransferError, kv_bytes_view
from pdserve.kv_transfer.codec import (
    AbortHeader, AckHeader, ClaimHeader, FrameError, FrameLimits, Header, HelloHeader, NotifyHeader, RenewHeader,
    StaleWrite, WriteHeader, encode_frame, read_frame,
)
from pdserve.kv_transfer.leases import EventKind, LeaseTable, ReceiverEvent
from pdserve.kv_transfer.listener import Listener, PeerLimits
from pdserve.kv_transfer.quant import ENCODINGS, dequantize_into, encoded_size
from pdserve.layers.kernels.native import serial_torch_on_this_thread

__all__ = ["EventKind", "KVReceiver", "ReceiverEvent"]
log = logging.getLogger("pdserve.kv_transfer")


class KVReceiver:
    def __init__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,
        events: queue.Queue,
        token: str = "",
        host: str = "127.0.0.1",
        port: int = 0,
        limits: FrameLimits = FrameLimits(),
        peers: PeerLimits = PeerLimits(),
        draft: DraftKV | None = None,
    ) -> None:
        self.layout = layout
        self.kv_cache = kv_cache
        self.draft = draft  # a draft model's cache, where this worker drafts with one
        self._parts = [_Part(layout, kv_cache, 0, False)] + ([_Part(draft.layout, draft.cache, layout.num_layers, True)]
                                                            if draft is not None else [])
        self.events = events
        self._token = token.encode()
        self.limits = limits
        self.peers = peers
        self.leases = LeaseTable(events, peers.release_grace_s)
        self._lock = threading.Lock()
        self._conns: set[_Connection] = set()
        self._closing = False
        self._listener = Listener(host, port, self._serve, peers)
        self.address = self._listener.address

    # -- engine thread -------------------------------------------------------------------------

    def open_lease(self, lease: Lease) -> None:
        self.leases.open(lease, self.layout.num_layers, self.draft.layout.num_layers if self.draft else 0)

    def close_lease(self, fence: int, reason: str) -> bool:
        """End a lease that has not landed (abort, timeout); idempotent. True if RELEASABLE is
        yet to come for it; False if the lease is gone (landed or already released)."""
        return self.leases.close(fence, reason)

    @property
    def num_open_leases(self) -> int:
        return self.leases.num_open

    def expired(self, now: float) -> list[Lease]:
        return self.leases.expired(now)

    def reclaim(self, now: float) -> int:
        """Cut off peers that pin closed leases past the grace period; see `LeaseTable.reclaim`."""
        return self.leases.reclaim(now)

    @property
    def num_connections(self) -> int:
        return self._listener.num_connections

    @property
    def num_refused_connections(self) -> int:
        return self._listener.num_refused_connections

    @property
    def num_forced_disconnects(self) -> int:
        return self.leases.num_forced_disconnects

    @property
    def num_stale_writes(self) -> int:
        return self.leases.num_stale_writes

    @property
    def bytes_received(self) -> int:
        return self.leases.bytes_received

    def close(self) -> None:
        with self._lock:
            self._closing = True
            conns = list(self._conns)
        self._listener.close()
        for conn in conns:
            conn.drop()

    def cut_connections(self) -> int:
        """Drop every prefill peer's connection, as a network fault would (fault injection); the
        listener stays open, so peers connect again. Each reader sees its connection break and
        fails the leases bound to it. Returns how many were dropped."""
        with self._lock:
            conns = list(self._conns)
        return sum(conn.drop() for conn in conns)

    # -- connections (a reader thread each) ----------------------------------------------------

    def _serve(self, sock: socket.socket, accepted_at: float) -> None:
        conn = _Connection(self, sock)
        with self._lock:
            closing = self._closing
            if not closing:
                self._conns.add(conn)
        if closing:
            sock.close()
            return
        try:
            conn.run(accepted_at + self.peers.hello_timeout_s)
        finally:
            with self._lock:
                self._conns.discard(conn)
            self.leases.disconnect(conn)

    def part_of(self, layers: range, encoding: str) -> _Part:
        """The cache these layers of a WRITE land in (the target's, or the draft model's after it);
        FrameError for layers outside both, or across them, or draft layers not sent raw."""
        for part in self._parts:
            if part.first <= layers.start and layers.stop <= part.first + part.layout.num_layers:
                if part.draft and encoding != "raw":
                    raise FrameError(f"draft model KV travels raw, not as {encoding}")
                return part
        raise FrameError(f"layers [{layers.start}, {layers.stop}) out of range")

    def admit(self, hello: HelloHeader) -> None:
        """A peer's HELLO: TransferError (the refusal it is sent) for a bad token or another layout."""
        if not hmac.compare_digest(hello.token.encode(), self._token):
            raise TransferError("bad token")
        peer = KVLayout(hello.model_hash, hello.num_layers, hello.num_kv_heads, hello.head_dim, hello.dtype)
        self.layout.check_compatible(peer)


class _Connection:
    """One prefill peer: a reader thread, and sends (acks, aborts) from any thread."""

    def __init__(self, receiver: KVReceiver, sock: socket.socket) -> None:
        self.rx = receiver
        self.sock = sock
        self._send_lock = threading.Lock()  # also orders shutdown and close: no call on a reused descriptor
        self._dropped = False
        self._closed = False
        self._after_payload = None  # staging to apply once a WRITE's payload is in

    def send(self, header: Header) -> None:
        """A control frame, sent without blocking: frames are small and a live peer reads them at
        once, so one that lets them pile up is dropped rather than allowed to stall the caller
        (the engine thread, when it aborts a lease)."""
        frame = encode_frame(header)[0]
        with self._send_lock:
            if self._closed:
                return
            try:
                complete = self.sock.send(frame, socket.MSG_DONTWAIT) == len(frame)
            except OSError:
                complete = False
        if not complete:
            self.drop()  # the reader sees the broken connection and cleans up

    def drop(self) -> bool:
        with self._send_lock:
            if self._dropped or self._closed:
                return False
            self._dropped = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return True

    def run(self, hello_deadline: float) -> None:
        serial_torch_on_this_thread()  # the engine thread keeps the process's only OpenMP pool
        try:
            hello = read_frame(self.sock, self.rx.limits, self._no_payload, deadline=hello_deadline)
            if not isinstance(hello, HelloHeader):
                raise FrameError("a connection must start with HELLO")
            try:
                self.rx.admit(hello)
            except TransferError as e:
                self.send(AckHeader("", 0, ok=False, error=str(e)))
                return
            self.send(AckHeader("", 0, ok=True))
            while True:
                try:
                    header = read_frame(self.sock, self.rx.limits, self._sink)
                except StaleWrite:  # counted by the lease table; its payload was read and dropped
                    continue
                self._handle(header)
        except (OSError, FrameError, TransferError):
            pass
        except Exception:  # a bug must not take the receiver down: this peer alone is dropped
            log.exception("KV connection from a prefill peer failed")
        finally:
            self.drop()
            with self._send_lock:
                self._closed = True
                self.sock.close()

    def _no_payload(self, header: WriteHeader, size: int) -> list[memoryview]:
        raise FrameError("WRITE before HELLO")

    def _sink(self, h: WriteHeader, size: int) -> list[memoryview]:
        rx = self.rx
        layers = range(h.layer, h.layer + h.num_layers)
        if h.encoding not in ENCODINGS:
            raise FrameError(f"unknown KV encoding {h.encoding!r}")
        if h.num_layers < 1 or h.layer < 0:
            raise FrameError(f"layers [{layers.start}, {layers.stop}) out of range")
        part = rx.part_of(layers, h.encoding)
        layout = part.layout
        if h.num_tokens < 1:
            raise FrameError(f"WRITE of {h.num_tokens} tokens")
        expected = h.num_layers * encoded_size(layout, h.num_tokens, h.encoding)
        if size != expected:
            raise FrameError(f"WRITE of {h.num_layers} x {h.num_tokens} tokens as {h.encoding} must carry "
                             f"{expected} bytes, got {size}")
        state = rx.leases.begin_write(h, self)
        self._after_payload = (state, h, part)
        runs = state.lease.slot_runs(h.start, h.start + h.num_tokens, part.draft)
        if h.encoding == "raw" and part.bytes is not None:
            return [part.bytes[i - part.first, s : s + n].numpy().data for i in layers for s, n in runs]
        if h.encoding == "direct":
            return []
        staging = torch.empty(size, dtype=torch.uint8)
        self._after_payload = (state, h, part, staging, runs)
        return [staging.numpy().data]

    def _handle(self, header: Header) -> None:
        rx = self.rx
        if isinstance(header, WriteHeader):
            state, h, part, *staged = self._after_payload
            self._after_payload = None
            layers = range(h.layer, h.layer + h.num_layers)
            per_layer = encoded_size(part.layout, h.num_tokens, h.encoding)
            if staged:
                staging, runs = staged
                for k, i in enumerate(layers):
                    dequantize_into(part.cache, i - part.first, runs, staging[k * per_layer : (k + 1) * per_layer],
                                    part.layout, h.encoding)
            direct = h.encoding == "direct"  # written in place: count what landed
            num_bytes = len(layers) * (h.num_tokens * part.layout.slot_bytes if direct else per_layer)
            rx.leases.end_write(state, layers, h.start + h.num_tokens, num_bytes)
        elif isinstance(header, ClaimHeader):
            error = rx.leases.claim(header.request_id, header.fence, self)
            self.send(AckHeader(header.request_id, header.fence, ok=not error, error=error))
        elif isinstance(header, NotifyHeader):
            rx.leases.notify(header, self)
        elif isinstance(header, AbortHeader):
            rx.leases.peer_stopped(header.request_id, header.fence, self, f"prefill aborted: {header.reason}")
        elif isinstance(header, AckHeader):
            rx.leases.peer_stopped(header.request_id, header.fence, self)
        elif isinstance(header, RenewHeader):
            try:
                rx.leases.renew(header.request_id, header.fence, self)
            except StaleWrite:
                pass  # a lease that ended meanwhile: nothing to keep waiting
        else:
            raise FrameError(f"unexpected {type(header).__name__} from a prefill peer")


class _Part:
    """One cache a WRITE may land in: the target's (layers from 0), or a draft model's (its layers
    numbered from `first`, after the target's)."""

    __slots__ = ("layout", "cache", "first", "draft", "bytes")

    def __init__(self, layout: KVLayout, cache: torch.Tensor, first: int, draft: bool) -> None:
        self.layout, self.cache, self.first, self.draft = layout, cache, first, draft
        self.bytes = kv_bytes_view(cache) if cache.device.type == "cpu" else None  # raw WRITEs land here
