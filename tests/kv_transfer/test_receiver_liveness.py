"""Peers that stall, trickle or vanish: the handshake and every frame have a deadline, idle time
between frames has none, dead peers are detected on both sides, and a peer that leaves an aborted
lease unacknowledged is cut off after the grace period, which releases the lease."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from pdserve.kv_transfer.codec import (
    AbortHeader, AckHeader, ClaimHeader, FrameLimits, NotifyHeader, WriteHeader, encode_frame,
)
from pdserve.kv_transfer.leases import EventKind
from pdserve.kv_transfer.listener import PeerLimits
from pdserve.kv_transfer import control
from pdserve.kv_transfer.base import TransferError
from pdserve.kv_transfer.control import DEAD_PEER_S
from pdserve.kv_transfer.tcp import TcpSender
from tests.kv_transfer.raw_peer import (
    LAYOUT, TOKEN, closed_by_peer, connect, hello_bytes, kv_data, make_receiver, next_event, open_lease, receive,
    send, settle,
)


class Trickle(threading.Thread):
    """Sends `data` a byte at a time, a little apart: each byte well within any per-read timeout."""

    def __init__(self, sock: socket.socket, data: bytes, gap_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.sock, self.data, self.gap_s = sock, data, gap_s
        self.sent = 0

    def run(self) -> None:
        try:
            for i in range(len(self.data)):
                self.sock.send(self.data[i : i + 1])
                self.sent += 1
                time.sleep(self.gap_s)
        except OSError:
            pass


def read_until_closed(sock: socket.socket) -> bytes:
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def test_the_handshake_has_a_deadline_for_the_whole_hello():
    rx = make_receiver(peers=PeerLimits(hello_timeout_s=0.5))
    try:
        slow = socket.create_connection(rx.address, timeout=30)
        trickle = Trickle(slow, hello_bytes())
        trickle.start()
        assert read_until_closed(slow) == b""  # hung up on, never acknowledged
        trickle.join(30)
        assert not trickle.is_alive()
        assert trickle.sent < len(hello_bytes())
        slow.close()
        connect(rx).close()  # and the port still serves others
    finally:
        rx.close()


def test_the_senders_handshake_has_a_deadline_too(monkeypatch):
    monkeypatch.setattr(control, "CONNECT_TIMEOUT_S", 0.5)
    ack = b"".join(bytes(b) for b in encode_frame(AckHeader("", 0, ok=True)))
    with socket.create_server(("127.0.0.1", 0)) as server:
        trickles: list[Trickle] = []

        def decode_side() -> None:
            conn, _ = server.accept()
            trickles.append(Trickle(conn, ack))
            trickles[0].run()  # the answer to its HELLO, a byte at a time
            conn.close()
        answering = threading.Thread(target=decode_side, daemon=True)
        answering.start()
        host, port = server.getsockname()
        with pytest.raises(TransferError, match="handshake"):
            TcpSender(LAYOUT, torch.zeros(2, 8, 2, 2, 4), {"host": host, "port": port}, token=TOKEN)
        answering.join(30)
        assert not answering.is_alive()
        assert trickles[0].sent < len(ack)


def test_a_frame_stalled_midway_drops_the_peer_and_releases_its_lease():
    rx = make_receiver(limits=FrameLimits(max_payload_bytes=1 << 16, frame_timeout_s=0.5))
    try:
        sock = connect(rx)
        lease = open_lease(rx)
        write = WriteHeader(lease.request_id, lease.fence, 0, 0, 8)
        frame = b"".join(bytes(b) for b in encode_frame(write, kv_data(8, 1)))
        sock.sendall(frame[: len(frame) - 300])  # the header and part of the payload, then a trickle
        trickle = Trickle(sock, frame[len(frame) - 300 :])
        trickle.start()
        assert closed_by_peer(sock)
        events = [next_event(rx), next_event(rx)]
        assert [(e.kind, e.fence) for e in events] == [
            (EventKind.FAILED, lease.fence), (EventKind.RELEASABLE, lease.fence)]
        assert trickle.sent < 300
        sock.close()
    finally:
        rx.close()


def test_a_connection_may_stay_idle_between_frames():
    rx = make_receiver(limits=FrameLimits(max_payload_bytes=1 << 16, frame_timeout_s=0.2))
    try:
        sock = connect(rx)
        lease = open_lease(rx)
        send(sock, WriteHeader(lease.request_id, lease.fence, 0, 0, 8), kv_data(8, 1))
        time.sleep(0.6)  # idle for several frame deadlines: a pooled sender between requests
        send(sock, WriteHeader(lease.request_id, lease.fence, 1, 0, 8), kv_data(8, 2))
        send(sock, NotifyHeader(lease.request_id, lease.fence, first_token=9, num_prompt_tokens=8))
        ev = next_event(rx)
        assert (ev.kind, ev.first_token) == (EventKind.LANDED, 9)
        assert rx.kv_cache[1, 3 * 4 : 4 * 4].eq(2).all()
        sock.close()
    finally:
        rx.close()


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="Linux socket options")
def test_both_sides_detect_a_vanished_peer():
    rx = make_receiver(peers=PeerLimits(dead_peer_s=8))
    sender = TcpSender(LAYOUT, rx.kv_cache.clone(), {"host": rx.address[0], "port": rx.address[1]}, token=TOKEN)
    try:
        (conn,) = rx._conns  # the receiver's end of the sender's connection
        for sock, seconds in ((sender.link.sock, DEAD_PEER_S), (conn.sock, 8)):
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == seconds * 1000
    finally:
        sender.close()
        rx.close()


def test_an_unacknowledged_abort_cuts_the_writer_off_after_the_grace_period():
    rx = make_receiver(peers=PeerLimits(release_grace_s=10))
    try:
        sock = connect(rx)
        aborted, live = open_lease(rx, blocks=(1, 2)), open_lease(rx, blocks=(3, 4), request_id="r2")
        for lease in (aborted, live):
            send(sock, ClaimHeader(lease.request_id, lease.fence))
            assert receive(sock).ok
        assert rx.close_lease(aborted.fence, "client gone")
        assert receive(sock) == AbortHeader(aborted.request_id, aborted.fence, "client gone")
        # The writer never acknowledges. Within the grace period its blocks stay pinned ...
        assert rx.reclaim(time.monotonic()) == 0
        settle(sock)
        assert rx.events.empty()
        # ... and past it, the writer is cut off: every lease bound to it is released.
        assert rx.reclaim(time.monotonic() + 11) == 1
        assert closed_by_peer(sock)
        events = {(e.kind, e.fence) for e in (next_event(rx), next_event(rx), next_event(rx))}
        assert events == {(EventKind.RELEASABLE, aborted.fence), (EventKind.FAILED, live.fence),
                          (EventKind.RELEASABLE, live.fence)}
        assert rx.num_forced_disconnects == 1 and rx.reclaim(time.monotonic() + 11) == 0
        connect(rx).close()
        sock.close()
    finally:
        rx.close()


def test_an_acknowledged_abort_needs_no_reclaim():
    rx = make_receiver(peers=PeerLimits(release_grace_s=10))
    try:
        sock = connect(rx)
        lease = open_lease(rx)
        send(sock, ClaimHeader(lease.request_id, lease.fence))
        assert receive(sock).ok
        rx.close_lease(lease.fence, "client gone")
        receive(sock)
        send(sock, AckHeader(lease.request_id, lease.fence, ok=True))
        assert next_event(rx).kind == EventKind.RELEASABLE
        assert rx.reclaim(time.monotonic() + 60) == 0  # nothing is pinned: nobody is cut off
        settle(sock)
        sock.close()
    finally:
        rx.close()
