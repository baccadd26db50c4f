"""The frame socket from a prefill worker to one decode peer, which every socket backend shares:
tcp sends the KV on it, in-place writers (shared memory, NIXL) only the frames saying what they
wrote.

Lifecycle of a link:
1. Connect, send HELLO (token, model hash, KV layout, backend); the peer answers with an ACK or a
   refusal (bad token, another model), which raises `TransferError` here.
2. Frames go out from one thread at a time (the sender's); a reader thread hands every frame the
   peer sends (ABORT, ACK) to the owner, and tells it once the link is lost.
3. A decode host that vanishes is noticed within `DEAD_PEER_S` (TCP keep-alive and user timeout),
   not the kernel's ~15 minutes.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

from pdserve.kv_transfer.base import KVLayout, TransferError
from pdserve.kv_transfer.codec import (
    AckHeader, FrameError, FrameLimits, Header, HelloHeader, StaleWrite, WriteHeader, encode_frame, read_frame,
)
from pdserve.net import detect_dead_peers

CONNECT_TIMEOUT_S = 5.0
DEAD_PEER_S = 30.0
MAX_IOV = 512  # buffers per sendmsg, below the kernel's IOV_MAX


class ControlLink:
    def __init__(self, peer: dict, layout: KVLayout, backend: str, token: str, name: str, limits: FrameLimits) -> None:
        self.backend = backend
        self.limits = limits
        self.sock = self._connect(peer_address(peer), layout, token, name)

    def _connect(self, address: tuple[str, int], layout: KVLayout, token: str, name: str) -> socket.socket:
        try:
            sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
        except (OSError, ValueError) as e:  # ValueError: a host name that cannot be encoded
            raise TransferError(f"cannot reach the decode worker's KV port for {self.backend}: {e}") from None
        # Blocking from here on: the reader and the sender thread share the socket. The handshake
        # gets a deadline of its own: a peer that answers a byte at a time must not hold it.
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        sock.settimeout(None)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # frames are small and latency-bound
            detect_dead_peers(sock, DEAD_PEER_S)
            sock.sendmsg(encode_frame(HelloHeader(
                token, layout.model_hash, layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype,
                self.backend, name)))
            ack = read_frame(sock, self.limits, _no_payload, deadline)
        except (OSError, FrameError) as e:
            sock.close()
            raise TransferError(f"KV handshake with the decode worker failed: {e}") from None
        if not isinstance(ack, AckHeader) or not ack.ok:
            sock.close()
            raise TransferError(f"the decode worker refused the KV connection: {getattr(ack, 'error', ack)}")
        return sock

    def start_reading(self, on_frame: Callable[[Header], None], on_lost: Callable[[], None]) -> None:
        """Hand each frame from the peer to `on_frame` (which raises FrameError for one it does not
        expect); `on_lost` once the link broke or a frame was refused."""
        def read_loop() -> None:
            try:
                while True:
                    on_frame(read_frame(self.sock, self.limits, _no_payload))
            except (OSError, FrameError, StaleWrite):
                on_lost()

        threading.Thread(target=read_loop, name=f"kv-read-{self.backend}", daemon=True).start()

    def send(self, header: Header, *payload) -> None:
        """One frame, in full (from one thread at a time); OSError if the link broke."""
        views = [memoryview(b).cast("B") for b in encode_frame(header, *payload)]
        while views:
            sent = self.sock.sendmsg(views[:MAX_IOV])
            while sent and views:
                if sent >= views[0].nbytes:
                    sent -= views[0].nbytes
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    def shutdown(self) -> None:
        """Break the link: the reader ends (and reports it lost), pending sends fail."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def peer_address(offer: dict) -> tuple[str, int]:
    """The decode worker's KV address in its offer (host, port); TransferError for anything else."""
    host, port = offer.get("host"), offer.get("port")
    if not isinstance(host, str) or not host or type(port) is not int or not 0 < port < 1 << 16:
        raise TransferError(f"bad KV address in the decode worker's offer: host {host!r}, port {port!r}")
    return host, port


def _no_payload(header: WriteHeader, size: int) -> list[memoryview]:
    raise FrameError("a decode peer sends no KV")
