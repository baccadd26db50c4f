"""A prefill peer spoken by hand over a real socket, and a small receiver to speak to."""

from __future__ import annotations

import queue
import secrets
import socket
import time

import torch

from pdserve.kv_transfer.base import KVLayout, Lease
from pdserve.kv_transfer.codec import ClaimHeader, FrameLimits, Header, HelloHeader, encode_frame, read_frame
from pdserve.kv_transfer.leases import ReceiverEvent
from pdserve.kv_transfer.listener import PeerLimits
from pdserve.kv_transfer.receiver import KVReceiver

LAYOUT = KVLayout("m" * 64, num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")
BLOCK = 4
NUM_BLOCKS = 16
TOKEN = "tok"


def make_receiver(
    limits: FrameLimits = FrameLimits(max_payload_bytes=1 << 16), peers: PeerLimits = PeerLimits()
) -> KVReceiver:
    kv = torch.zeros(LAYOUT.num_layers, NUM_BLOCKS * BLOCK, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return KVReceiver(LAYOUT, kv, queue.Queue(), token=TOKEN, limits=limits, peers=peers)


def hello(token: str = TOKEN, layout: KVLayout = LAYOUT) -> HelloHeader:
    return HelloHeader(token, layout.model_hash, layout.num_layers, layout.num_kv_heads, layout.head_dim,
                       layout.dtype, "tcp", "test")


def hello_bytes() -> bytes:
    return b"".join(encode_frame(hello()))


def connect(rx: KVReceiver, say_hello: bool = True) -> socket.socket:
    sock = socket.create_connection(rx.address, timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # frame after frame, no delayed-ACK waits
    if say_hello:
        sock.sendall(hello_bytes())
        ack = receive(sock)
        assert ack.ok, ack
    return sock


def send(sock: socket.socket, header: Header, *payload: bytes) -> None:
    sock.sendall(b"".join(bytes(b) for b in encode_frame(header, *payload)))


def receive(sock: socket.socket) -> Header:
    return read_frame(sock, FrameLimits(), lambda h, n: [])


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed the connection (waits for it, or for the socket's timeout)."""
    try:
        while True:
            if sock.recv(4096) == b"":
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def open_lease(rx: KVReceiver, blocks=(3, 5), start: int = 0, end: int = 8, request_id: str = "r1") -> Lease:
    lease = Lease(request_id, secrets.randbits(62) or 1, list(blocks), BLOCK, start, end, time.monotonic() + 30)
    rx.open_lease(lease)
    return lease


def kv_data(num_tokens: int, value: float) -> bytes:
    return torch.full((num_tokens, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim), float(value)).numpy().tobytes()


def next_event(rx: KVReceiver, timeout: float = 10.0) -> ReceiverEvent:
    return rx.events.get(timeout=timeout)


def settle(sock: socket.socket) -> None:
    """Wait until the receiver has handled everything sent so far (a claim round trip)."""
    send(sock, ClaimHeader("nobody", 0))
    assert not receive(sock).ok
