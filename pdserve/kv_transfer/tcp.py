"""The prefill side of KV transfer over a socket: pdserve's own framed protocol.

Lifecycle of a connection to one decode peer:
1. Connect, send HELLO (token, model hash, KV layout); the peer answers with an ACK or a refusal
   (bad token, another model), which raises `TransferError` here.
2. The engine thread queues WRITEs (one layer, a range of positions) and returns at once; the
   sender thread sends them in order, the payload gathered straight from the cache's slots.
   `flush()` waits until queued writes no longer need the source memory.
3. NOTIFY follows a request's writes; an ABORT from the peer stops the request's writes, is
   reported to the prefill worker, and is acknowledged after the last write that was in flight.
4. A broken connection fails every request that used it. A decode host that vanishes is noticed
   within `DEAD_PEER_S` (TCP keep-alive and user timeout), not the kernel's ~15 minutes.
Subclasses (in_place.py: shared memory, NIXL) write the bytes in place and send only the frames.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from typing import Callable

import torch

from pdserve.kv_transfer.base import KVLayout, Lease, TransferError, TransferStatus, kv_bytes_view
from pdserve.kv_transfer.codec import (
    AbortHeader, AckHeader, FrameError, FrameLimits, HelloHeader, NotifyHeader, StaleWrite, WriteHeader,
    encode_frame, read_frame,
)
from pdserve.kv_transfer.quant import encoded_size, gather_slots, quantize
from pdserve.net import detect_dead_peers

log = logging.getLogger("pdserve.kv_transfer")

CONNECT_TIMEOUT_S = 5.0
DEAD_PEER_S = 30.0
MAX_IOV = 512  # buffers per sendmsg, below the kernel's IOV_MAX


class TcpSender:
    backend = "tcp"

    def __init__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,
        peer: dict,
        token: str = "",
        name: str = "prefill",
        encoding: str = "raw",
        on_peer_abort: Callable[[str, int | None], None] = lambda request_id, fence: None,
        limits: FrameLimits = FrameLimits(),
    ) -> None:
        self.layout = layout
        self.kv_cache = kv_cache
        self.encoding = encoding
        self.on_peer_abort = on_peer_abort
        self.limits = limits
        self._kv_bytes = kv_bytes_view(kv_cache) if kv_cache.device.type == "cpu" else None
        self._status: dict[str, TransferStatus] = {}
        self._aborted_fences: set[int] = set()
        self._jobs: deque = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self.bytes_sent = 0
        self._setup(peer)
        try:
            self.sock = self._connect(peer, token, name)
        except TransferError:
            self._teardown()
            raise
        threading.Thread(target=self._send_loop, name=f"kv-send-{self.backend}", daemon=True).start()
        threading.Thread(target=self._read_loop, name=f"kv-read-{self.backend}", daemon=True).start()

    def _setup(self, peer: dict) -> None:
        """Backend-specific preparation before connecting (e.g. mapping the peer's memory)."""

    def _teardown(self) -> None:
        """Undo `_setup`, once no write can run any more."""

    def _connect(self, peer: dict, token: str, name: str) -> socket.socket:
        try:
            sock = socket.create_connection(peer_address(peer), timeout=CONNECT_TIMEOUT_S)
        except (OSError, ValueError) as e:  # ValueError: a host name that cannot be encoded
            raise TransferError(f"cannot reach the decode worker's KV port for {self.backend}: {e}") from None
        # Blocking from here on: the reader and the sender thread share the socket. The handshake
        # gets a deadline of its own: a peer that answers a byte at a time must not hold it.
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        sock.settimeout(None)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # frames are small and latency-bound
            detect_dead_peers(sock, DEAD_PEER_S)
            lay = self.layout
            sock.sendmsg(encode_frame(HelloHeader(
                token, lay.model_hash, lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype, self.backend, name)))
            ack = read_frame(sock, self.limits, _no_payload, deadline)
        except (OSError, FrameError) as e:
            sock.close()
            raise TransferError(f"KV handshake with the decode worker failed: {e}") from None
        if not isinstance(ack, AckHeader) or not ack.ok:
            sock.close()
            raise TransferError(f"the decode worker refused the KV connection: {getattr(ack, 'error', ack)}")
        return sock

    # -- the non-blocking interface (engine thread) ----------------------------------------------

    def write(self, lease: Lease, layer: int, start: int, end: int, src_runs: list[tuple[int, int]]) -> None:
        """Queue layer `layer`'s KV of positions [start, end), read from this side's slot runs
        (in pieces, if one would pass a quarter of the frame size limit)."""
        self._status.setdefault(lease.request_id, TransferStatus.PENDING)
        step = max(1, self.limits.max_payload_bytes // 4 // self.layout.slot_bytes)
        for first in range(start, end, step):
            last = min(end, first + step)
            runs = src_runs if (first, last) == (start, end) else cut_runs(src_runs, first - start, last - start)
            self._push(("write", lease, range(layer, layer + 1), first, last, runs))

    def check(self, lease: Lease) -> None:
        """Raise ValueError if the lease names memory this sender cannot write."""

    def prepare(self, lease: Lease) -> None:
        """Get ready to write the lease (in-place writers claim it), while its prefill computes."""

    def notify(self, lease: Lease, first_token: int, times: tuple[float, float] = (0.0, 0.0)) -> None:
        """After the lease's writes: the first token, and (queue, compute) seconds spent here."""
        self._push(("notify", lease, first_token, times))

    def abort(self, lease: Lease, reason: str) -> None:
        self._push(("abort", lease, reason))

    def poll(self, request_id: str) -> TransferStatus:
        return self._status.get(request_id, TransferStatus.PENDING)

    def forget(self, lease: Lease) -> None:
        """Drop the request's bookkeeping once everything queued for it went out."""
        self._push(("forget", lease))

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued job was sent (its source memory may then be reused)."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._jobs and not self._busy or self._closed, timeout):
                raise TransferError(f"KV writes to the decode worker did not drain within {timeout:.0f}s")

    @property
    def alive(self) -> bool:
        return not self._closed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- sender thread -------------------------------------------------------------------------

    def _push(self, job: tuple) -> None:
        with self._cond:
            if self._closed:
                if job[0] in ("write", "notify"):
                    self._status[job[1].request_id] = TransferStatus.FAILED
                return
            self._jobs.append(job)
            self._cond.notify_all()

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if self._closed:
                    self._fail_all()
                    self._teardown()
                    return
                job = self._coalesce(self._jobs.popleft())
                self._busy = True
            try:
                self._run(job)
            except (OSError, TransferError) as e:
                log.warning("KV link to the decode worker (%s) failed: %s", self.backend, e)
                self.close()
            except Exception:  # a bug must not leave requests waiting on a dead thread
                log.exception("KV sender (%s) failed", self.backend)
                self.close()
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _coalesce(self, job: tuple) -> tuple:
        """Merge queued writes of the next layers of the same positions into one job (one copy,
        one transfer, one frame), up to a quarter of the frame size limit. Called under the lock."""
        if job[0] != "write":
            return job
        max_layers = self._max_layers_per_write(job[4] - job[3])
        while self._jobs and len(job[2]) < max_layers:
            nxt = self._jobs[0]
            if not (nxt[0] == "write" and nxt[1] is job[1] and nxt[3:] == job[3:] and nxt[2].start == job[2].stop):
                break
            self._jobs.popleft()
            job = ("write", job[1], range(job[2].start, nxt[2].stop), *job[3:])
        return job

    def _max_layers_per_write(self, num_tokens: int) -> int:
        per_layer = max(1, encoded_size(self.layout, num_tokens, self.encoding))
        return max(1, self.limits.max_payload_bytes // 4 // per_layer)

    def _run(self, job: tuple) -> None:
        kind, lease = job[0], job[1]
        if kind == "ack":
            self._send(encode_frame(AckHeader(lease.request_id, lease.fence, ok=True)))
            return
        if kind == "forget":
            self._status.pop(lease.request_id, None)
            self._aborted_fences.discard(lease.fence)
            self._forget_lease(lease)
            return
        if lease.fence in self._aborted_fences:
            return  # the peer gave this lease up: nothing more goes to it
        if kind == "write":
            self._write(lease, *job[2:])
        elif kind == "claim":
            self._claim(lease)
        elif kind == "notify":
            self._send(encode_frame(NotifyHeader(lease.request_id, lease.fence, job[2], lease.end, *job[3])))
            self._status[lease.request_id] = TransferStatus.DONE
        elif kind == "abort":
            self._aborted_fences.add(lease.fence)
            self._send(encode_frame(AbortHeader(lease.request_id, lease.fence, job[2])))
            self._status[lease.request_id] = TransferStatus.ABORTED

    def _write(self, lease: Lease, layers: range, start: int, end: int, src_runs: list[tuple[int, int]]) -> None:
        payload = []
        for layer in layers:
            if self.encoding == "raw" and self._kv_bytes is not None:
                payload += [self._kv_bytes[layer, s : s + n].numpy().data for s, n in src_runs]
            elif self.encoding == "raw":
                payload.append(gather_slots(self.kv_cache, layer, src_runs).cpu().view(torch.uint8).numpy().data)
            else:
                payload.append(quantize(gather_slots(self.kv_cache, layer, src_runs), self.encoding))
        header = WriteHeader(lease.request_id, lease.fence, layers.start, start, end - start, self.encoding, len(layers))
        self._send(encode_frame(header, *payload))
        self.bytes_sent += sum(memoryview(p).nbytes for p in payload)

    def _send(self, buffers: list) -> None:
        view_list = [memoryview(b).cast("B") for b in buffers]
        while view_list:
            sent = self.sock.sendmsg(view_list[:MAX_IOV])
            while sent and view_list:
                if sent >= view_list[0].nbytes:
                    sent -= view_list[0].nbytes
                    view_list.pop(0)
                else:
                    view_list[0] = view_list[0][sent:]
                    sent = 0

    def _forget_lease(self, lease: Lease) -> None:
        """Backend-specific bookkeeping of a lease to drop."""

    def _fail_all(self) -> None:
        for request_id, status in self._status.items():
            if status == TransferStatus.PENDING:
                self._status[request_id] = TransferStatus.FAILED
                self.on_peer_abort(request_id, None)

    # -- reader thread -------------------------------------------------------------------------

    def _read_loop(self) -> None:
        try:
            while True:
                self._on_frame(read_frame(self.sock, self.limits, _no_payload))
        except (OSError, FrameError, StaleWrite):
            self.close()

    def _on_frame(self, header) -> None:
        if isinstance(header, AbortHeader):
            with self._cond:
                self._aborted_fences.add(header.fence)
            if self._status.get(header.request_id) == TransferStatus.PENDING:
                self._status[header.request_id] = TransferStatus.ABORTED
            self.on_peer_abort(header.request_id, header.fence)
            # after whatever write is in flight: the ack promises no more writes follow
            self._push(("ack", Lease(header.request_id, header.fence, [], 1, 0, 0, 0.0)))
        elif isinstance(header, AckHeader):
            self._on_ack(header)
        else:
            raise FrameError(f"unexpected {type(header).__name__} from a decode peer")

    def _on_ack(self, ack: AckHeader) -> None:
        """Acknowledgements of claims (in-place writers); plain tcp sends none."""


def peer_address(offer: dict) -> tuple[str, int]:
    """The decode worker's KV address in its offer (host, port); TransferError for anything else."""
    host, port = offer.get("host"), offer.get("port")
    if not isinstance(host, str) or not host or type(port) is not int or not 0 < port < 1 << 16:
        raise TransferError(f"bad KV address in the decode worker's offer: host {host!r}, port {port!r}")
    return host, port


def cut_runs(runs: list[tuple[int, int]], begin: int, end: int) -> list[tuple[int, int]]:
    """Slots [begin, end) of the sequence that the runs (first slot, count) describe."""
    out, offset = [], 0
    for slot, n in runs:
        lo, hi = max(begin, offset), min(end, offset + n)
        if lo < hi:
            out.append((slot + lo - offset, hi - lo))
        offset += n
    return out


def _no_payload(header: WriteHeader, size: int) -> list[memoryview]:
    raise FrameError("a decode peer sends no KV")
