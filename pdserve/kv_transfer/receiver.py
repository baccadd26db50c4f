"""The decode side of KV transfer: leases, the listening socket, and what prefill peers send.

Lifecycle of a lease:
1. `open_lease` (engine thread): the request's reserved blocks may now be written under its fence.
2. A peer connects (HELLO: token and KV layout checked) and WRITEs layers of position ranges. A
   tcp WRITE lands straight in the blocks; a CLAIM binds the lease to a peer that writes in place
   (shared memory, NIXL) and then only reports its "direct" WRITEs.
3. NOTIFY with the first token: if every layer is complete the lease ends and LANDED is emitted.
4. Any other end (peer ABORT, peer lost, `close_lease` on abort or timeout) emits FAILED for a live
   lease, and RELEASABLE once no write can touch its blocks any more: at once for receiver-written
   leases with no write in flight, after the in-place writer acknowledged the abort, or when that
   peer's connection is gone.
Writes with an unknown, closed or mismatched fence are dropped (`StaleWrite`), never written.
"""

from __future__ import annotations

import enum
import hmac
import queue
import socket
import threading
from dataclasses import dataclass

import torch

from pdserve.kv_transfer.base import KVLayout, Lease, TransferError, kv_bytes_view
from pdserve.kv_transfer.codec import (
    AbortHeader, AckHeader, ClaimHeader, FrameError, FrameLimits, HelloHeader, NotifyHeader, StaleWrite,
    WriteHeader, encode_frame, read_frame,
)
from pdserve.kv_transfer.quant import dequantize_into, encoded_size

HELLO_TIMEOUT_S = 10.0


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


class _LeaseState:
    __slots__ = ("lease", "conn", "direct", "inflight", "closed", "released")

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.conn: _Connection | None = None  # the peer writing it, once one did
        self.direct = False  # that peer writes in place
        self.inflight = 0  # WRITE payloads being received into its blocks right now
        self.closed = False
        self.released = False


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
    ) -> None:
        self.layout = layout
        self.kv_cache = kv_cache
        self._kv_bytes = kv_bytes_view(kv_cache) if kv_cache.device.type == "cpu" else None
        self.events = events
        self._token = token.encode()
        self.limits = limits
        self._lock = threading.Lock()
        self._leases: dict[int, _LeaseState] = {}  # by fence
        self._conns: set[_Connection] = set()
        self.num_stale_writes = 0
        self.bytes_received = 0
        self._listener = socket.create_server((host, port))
        self.address = self._listener.getsockname()[:2]
        self._closing = False
        threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True).start()

    # -- engine thread -------------------------------------------------------------------------

    def open_lease(self, lease: Lease) -> None:
        lease.received = [lease.start] * self.layout.num_layers  # per layer: high-water position
        with self._lock:
            assert lease.fence not in self._leases, f"fence {lease.fence} reused"
            self._leases[lease.fence] = _LeaseState(lease)

    def close_lease(self, fence: int, reason: str) -> bool:
        """End a lease that has not landed (abort, timeout); idempotent. True if RELEASABLE is
        yet to come for it; False if the lease is gone (landed or already released)."""
        with self._lock:
            state = self._leases.get(fence)
            if state is None:
                return False
            if state.closed:
                return True
            state.closed = True
            conn = state.conn
            ready = self._release_ready(state)
        if conn is not None:
            conn.send(encode_frame(AbortHeader(state.lease.request_id, fence, reason)))
        if ready:
            self._release(state)
        return True

    @property
    def num_open_leases(self) -> int:
        with self._lock:
            return sum(1 for s in self._leases.values() if not s.closed)

    def expired(self, now: float) -> list[Lease]:
        with self._lock:
            return [s.lease for s in self._leases.values() if not s.closed and s.lease.deadline < now]

    def close(self) -> None:
        self._closing = True
        self._listener.close()
        for conn in list(self._conns):
            conn.shutdown()

    # -- lease bookkeeping (any thread, under the lock) -----------------------------------------

    def _release_ready(self, state: _LeaseState) -> bool:
        # An in-place writer may still be copying until it acknowledged the abort.
        return state.closed and state.inflight == 0 and not (state.direct and state.conn is not None)

    def _release(self, state: _LeaseState) -> None:
        with self._lock:
            if state.released:
                return
            state.released = True
            self._leases.pop(state.lease.fence, None)
        self.events.put(ReceiverEvent(EventKind.RELEASABLE, state.lease.request_id, state.lease.fence))

    def _fail(self, state: _LeaseState, reason: str) -> None:
        """The peer ended a live lease: decode recomputes. Caller holds no lock."""
        with self._lock:
            if state.closed:
                return
            state.closed = True
        self.events.put(ReceiverEvent(EventKind.FAILED, state.lease.request_id, state.lease.fence, reason=reason))

    def _live_state(self, request_id: str, fence: int, conn: _Connection) -> _LeaseState:
        state = self._leases.get(fence)
        if state is None or state.closed or state.lease.request_id != request_id:
            raise StaleWrite(f"no open lease {fence} for request {request_id!r}")
        if state.conn is not None and state.conn is not conn:
            raise StaleWrite(f"lease {fence} is bound to another peer")
        return state

    # -- connections ---------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # acks and aborts are small
            conn = _Connection(self, sock)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=conn.run, name="kv-recv", daemon=True).start()

    def _handshake(self, conn: _Connection, hello: HelloHeader) -> None:
        if not hmac.compare_digest(hello.token.encode(), self._token):
            raise TransferError("bad token")
        peer = KVLayout(hello.model_hash, hello.num_layers, hello.num_kv_heads, hello.head_dim, hello.dtype)
        self.layout.check_compatible(peer)

    def _on_disconnect(self, conn: _Connection) -> None:
        with self._lock:
            self._conns.discard(conn)
            bound = [s for s in self._leases.values() if s.conn is conn]
        for state in bound:
            self._fail(state, "prefill peer disconnected")
            with self._lock:
                state.conn = None
                state.inflight = 0  # this connection's reader, the only one writing it, has ended
            self._release(state)


class _Connection:
    """One prefill peer: a reader thread, and sends (acks, aborts) from any thread."""

    def __init__(self, receiver: KVReceiver, sock: socket.socket) -> None:
        self.rx = receiver
        self.sock = sock
        self._send_lock = threading.Lock()
        self._after_payload = None  # staging to apply once a WRITE's payload is in

    def send(self, buffers) -> None:
        try:
            with self._send_lock:
                self.sock.sendmsg(buffers)
        except OSError:
            pass  # the reader sees the broken connection and cleans up

    def shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def run(self) -> None:
        try:
            self.sock.settimeout(HELLO_TIMEOUT_S)
            hello = read_frame(self.sock, self.rx.limits, self._no_payload)
            if not isinstance(hello, HelloHeader):
                raise FrameError("a connection must start with HELLO")
            try:
                self.rx._handshake(self, hello)
            except TransferError as e:
                self.send(encode_frame(AckHeader("", 0, ok=False, error=str(e))))
                return
            self.send(encode_frame(AckHeader("", 0, ok=True)))
            self.sock.settimeout(None)
            while True:
                try:
                    header = read_frame(self.sock, self.rx.limits, self._sink)
                except StaleWrite:
                    self.rx.num_stale_writes += 1
                    continue
                self._handle(header)
        except (OSError, FrameError, TransferError):
            pass
        finally:
            self.shutdown()
            self.sock.close()
            self.rx._on_disconnect(self)

    def _no_payload(self, header: WriteHeader, size: int) -> list[memoryview]:
        raise FrameError("WRITE before HELLO")

    def _sink(self, h: WriteHeader, size: int) -> list[memoryview]:
        rx, layout = self.rx, self.rx.layout
        layers = range(h.layer, h.layer + h.num_layers)
        with rx._lock:
            state = rx._live_state(h.request_id, h.fence, self)
            lease = state.lease
            if h.num_layers < 1 or not 0 <= h.layer or layers.stop > layout.num_layers:
                raise FrameError(f"layers [{layers.start}, {layers.stop}) out of range")
            if not all(lease.start <= h.start <= lease.received[i] for i in layers) or h.start + h.num_tokens > lease.end:
                raise FrameError(f"positions [{h.start}, {h.start + h.num_tokens}) outside lease {lease.fence}")
            if h.encoding == "direct" and not state.direct:
                raise FrameError("direct WRITE on an unclaimed lease")
            expected = h.num_layers * encoded_size(layout, h.num_tokens, h.encoding)
            if size != expected:
                raise FrameError(f"WRITE of {h.num_layers} x {h.num_tokens} tokens as {h.encoding} must carry "
                                 f"{expected} bytes, got {size}")
            state.conn = self
            state.inflight += 1
        self._after_payload = (state, h)
        runs = lease.slot_runs(h.start, h.start + h.num_tokens)
        if h.encoding == "raw" and rx._kv_bytes is not None:
            return [rx._kv_bytes[i, s : s + n].numpy().data for i in layers for s, n in runs]
        if h.encoding == "direct":
            return []
        staging = torch.empty(size, dtype=torch.uint8)
        self._after_payload = (state, h, staging, runs)
        return [staging.numpy().data]

    def _handle(self, header) -> None:
        rx = self.rx
        if isinstance(header, WriteHeader):
            state, h, *staged = self._after_payload
            self._after_payload = None
            layers = range(h.layer, h.layer + h.num_layers)
            per_layer = encoded_size(rx.layout, h.num_tokens, h.encoding)
            if staged:
                staging, runs = staged
                for k, i in enumerate(layers):
                    dequantize_into(rx.kv_cache, i, runs, staging[k * per_layer : (k + 1) * per_layer], rx.layout, h.encoding)
            direct = h.encoding == "direct"  # written in place: count what landed
            rx.bytes_received += len(layers) * (h.num_tokens * rx.layout.slot_bytes if direct else per_layer)
            with rx._lock:
                state.inflight -= 1
                lease = state.lease
                for i in layers:
                    lease.received[i] = max(lease.received[i], h.start + h.num_tokens)
                ready = rx._release_ready(state)
            if ready:
                rx._release(state)
        elif isinstance(header, ClaimHeader):
            with rx._lock:
                try:
                    state = rx._live_state(header.request_id, header.fence, self)
                    state.conn, state.direct = self, True
                    ack = AckHeader(header.request_id, header.fence, ok=True)
                except StaleWrite as e:
                    ack = AckHeader(header.request_id, header.fence, ok=False, error=str(e))
            self.send(encode_frame(ack))
        elif isinstance(header, NotifyHeader):
            self._on_notify(header)
        elif isinstance(header, AbortHeader):
            self._on_peer_end(header.fence, f"prefill aborted: {header.reason}")
        elif isinstance(header, AckHeader):
            self._on_peer_end(header.fence, "")
        else:
            raise FrameError(f"unexpected {type(header).__name__} from a prefill peer")

    def _on_notify(self, h: NotifyHeader) -> None:
        rx = self.rx
        with rx._lock:
            state = rx._leases.get(h.fence)
            if state is None or state.closed or state.conn not in (None, self) or state.lease.request_id != h.request_id:
                return  # a late notify for a lease already ended: nothing to do
            complete = state.lease.complete and state.inflight == 0
            state.closed = True
            if complete:
                state.released = True  # the blocks stay with the request
                del rx._leases[h.fence]
        if complete:
            rx.events.put(ReceiverEvent(EventKind.LANDED, h.request_id, h.fence, first_token=h.first_token,
                                        prefill_times=(h.prefill_queue_s, h.prefill_compute_s)))
        else:
            rx.events.put(ReceiverEvent(EventKind.FAILED, h.request_id, h.fence, reason="notified before all KV landed"))
            self._after_peer_stopped(state)

    def _on_peer_end(self, fence: int, reason: str) -> None:
        """The peer stopped writing this lease: it aborted, or acknowledged our abort."""
        with self.rx._lock:
            state = self.rx._leases.get(fence)
            if state is None or state.conn not in (None, self):
                return
        if reason:
            self.rx._fail(state, reason)
        self._after_peer_stopped(state)

    def _after_peer_stopped(self, state: _LeaseState) -> None:
        with self.rx._lock:
            state.conn = None  # it will not write again: no acknowledgement to wait for
            ready = self.rx._release_ready(state)
        if ready:
            self.rx._release(state)
