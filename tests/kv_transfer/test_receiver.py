"""The decode side's receiver against a raw socket: handshake, fences, stale and late writes,
in-place claims, malformed and oversized frames; nothing lands where it must not."""

from __future__ import annotations

import queue
import socket
import time

import pytest
import torch

from pdserve.kv_transfer.base import KVLayout, Lease
from pdserve.kv_transfer.codec import (
    PREFIX, AckHeader, ClaimHeader, FrameLimits, HelloHeader, NotifyHeader, WriteHeader, encode_frame, read_frame,
)
from pdserve.kv_transfer.receiver import EventKind, KVReceiver
from tests.wait import wait_for

LAYOUT = KVLayout("m" * 64, num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")
BLOCK = 4


@pytest.fixture
def rx():
    kv = torch.zeros(LAYOUT.num_layers, 16 * BLOCK, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    receiver = KVReceiver(LAYOUT, kv, queue.Queue(), token="tok", limits=FrameLimits(max_payload_bytes=1 << 16))
    yield receiver
    receiver.close()


def hello(token="tok", layout=LAYOUT):
    return HelloHeader(token, layout.model_hash, layout.num_layers, layout.num_kv_heads, layout.head_dim,
                       layout.dtype, "tcp", "test")


def connect(rx, token="tok", layout=LAYOUT):
    sock = socket.create_connection(rx.address, timeout=5)
    sock.sendmsg(encode_frame(hello(token, layout)))
    ack = read_frame(sock, FrameLimits(), lambda h, n: [])
    return sock, ack


def lease(rx, fence, blocks=(3, 5), start=0, end=8):
    lease = Lease("r1", fence, list(blocks), BLOCK, start, end, time.monotonic() + 30)
    rx.open_lease(lease)
    return lease


def data(num_tokens, value):
    return torch.full((num_tokens, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim), float(value)).numpy().tobytes()


def event(rx, timeout=5.0):
    return rx.events.get(timeout=timeout)


def settle(rx, sock):
    """Wait until the receiver has handled everything sent so far (a claim round trip)."""
    sock.sendmsg(encode_frame(ClaimHeader("nobody", 999_999)))
    read_frame(sock, FrameLimits(), lambda h, n: [])


def test_writes_land_and_notify_completes_the_lease(rx):
    sock, ack = connect(rx)
    assert ack.ok
    lease(rx, fence=7)
    for layer in range(2):
        sock.sendmsg(encode_frame(WriteHeader("r1", 7, layer, 0, 8), data(8, layer + 1)))
    sock.sendmsg(encode_frame(NotifyHeader("r1", 7, first_token=42, num_prompt_tokens=8)))
    ev = event(rx)
    assert (ev.kind, ev.first_token) == (EventKind.LANDED, 42)
    assert torch.all(rx.kv_cache[1, 3 * BLOCK : 4 * BLOCK] == 2) and torch.all(rx.kv_cache[0, 5 * BLOCK : 6 * BLOCK] == 1)
    assert rx.kv_cache.sum() == 8 * 2 * 2 * 4 * (1 + 2)  # nothing outside the lease's blocks
    sock.close()


def test_stale_and_late_writes_are_rejected(rx):
    sock, _ = connect(rx)
    lease(rx, fence=7)
    sock.sendmsg(encode_frame(WriteHeader("r1", 6, 0, 0, 8), data(8, 9)))  # an older fence
    sock.sendmsg(encode_frame(WriteHeader("other", 7, 0, 0, 8), data(8, 9)))  # another request's
    settle(rx, sock)
    assert rx.num_stale_writes == 2 and rx.kv_cache.abs().sum() == 0
    assert rx.close_lease(7, "aborted")
    assert event(rx).kind == EventKind.RELEASABLE  # no write in flight: the blocks are free at once
    sock.sendmsg(encode_frame(WriteHeader("r1", 7, 0, 0, 8), data(8, 9)))  # late: after the abort
    sock.sendmsg(encode_frame(NotifyHeader("r1", 7, 1, 8)))  # late notify: ignored
    settle(rx, sock)
    assert rx.num_stale_writes == 3 and rx.kv_cache.abs().sum() == 0
    assert rx.events.empty()
    sock.close()


def test_notify_before_all_layers_landed_fails_the_lease(rx):
    sock, _ = connect(rx)
    lease(rx, fence=3)
    sock.sendmsg(encode_frame(WriteHeader("r1", 3, 0, 0, 8), data(8, 1)))
    sock.sendmsg(encode_frame(NotifyHeader("r1", 3, 5, 8)))
    kinds = [event(rx).kind, event(rx).kind]
    assert kinds == [EventKind.FAILED, EventKind.RELEASABLE]
    sock.close()


def test_claimed_lease_waits_for_the_in_place_writer(rx):
    sock, _ = connect(rx)
    lease(rx, fence=4)
    sock.sendmsg(encode_frame(ClaimHeader("r1", 4)))
    assert read_frame(sock, FrameLimits(), lambda h, n: []).ok
    assert rx.close_lease(4, "client gone")
    abort = read_frame(sock, FrameLimits(), lambda h, n: [])  # the writer is told ...
    assert abort.fence == 4 and rx.events.empty()  # ... and the blocks wait for its answer
    sock.sendmsg(encode_frame(AckHeader("r1", 4, ok=True)))
    assert event(rx).kind == EventKind.RELEASABLE
    sock.sendmsg(encode_frame(ClaimHeader("r1", 4)))  # a claim of the closed lease is refused
    assert not read_frame(sock, FrameLimits(), lambda h, n: []).ok
    sock.close()


def test_a_lost_in_place_writer_releases_its_leases(rx):
    sock, _ = connect(rx)
    lease(rx, fence=8)
    sock.sendmsg(encode_frame(ClaimHeader("r1", 8)))
    read_frame(sock, FrameLimits(), lambda h, n: [])
    sock.close()
    assert [event(rx).kind, event(rx).kind] == [EventKind.FAILED, EventKind.RELEASABLE]


@pytest.mark.parametrize("token, layout, message", [
    ("wrong", LAYOUT, "bad token"),
    ("tok", KVLayout("x" * 64, 2, 2, 4, "float32"), "model mismatch"),
    ("tok", KVLayout("m" * 64, 2, 2, 4, "bfloat16"), "KV dtype mismatch"),
    ("tok", KVLayout("m" * 64, 2, 2, 8, "float32"), "layout mismatch"),
])
def test_handshake_refusals_are_explained(rx, token, layout, message):
    sock, ack = connect(rx, token, layout)
    assert not ack.ok and message in ack.error
    sock.close()


@pytest.mark.parametrize("frame", [
    b"GET / HTTP/1.1\r\nHost: kv\r\n\r\n",  # not our protocol at all
    PREFIX.pack(b"PDKV", 1, 2, 0, 10, 1 << 40),  # oversized payload
    PREFIX.pack(b"PDKV", 1, 2, 0, 1 << 30, 0),  # oversized header
    PREFIX.pack(b"PDKV", 1, 4, 0, 3, 0) + b"\xc1\xc1\xc1",  # malformed msgpack
])
def test_malformed_frames_drop_the_connection_not_the_receiver(rx, frame):
    sock, _ = connect(rx)
    lease(rx, fence=2)
    sock.sendall(frame)
    sock.settimeout(5)
    assert sock.recv(100) == b""  # the receiver hung up
    assert rx.num_open_leases == 1  # a lease this peer never wrote stays open for others
    good, ack = connect(rx)  # and still serves others
    assert ack.ok
    good.close()
    sock.close()


def test_writes_outside_the_lease_are_refused(rx):
    sock, _ = connect(rx)
    lease(rx, fence=5, start=4)
    sock.sendmsg(encode_frame(WriteHeader("r1", 5, 0, 0, 8), data(8, 1)))  # starts before the lease
    sock.settimeout(5)
    assert sock.recv(100) == b""
    assert rx.kv_cache.abs().sum() == 0
    sock.close()


def test_a_write_larger_than_the_frame_limit_goes_in_pieces(rx):
    from pdserve.kv_transfer.base import cut_runs
    from pdserve.kv_transfer.tcp import TcpSender

    assert cut_runs([(10, 4), (40, 4)], 2, 7) == [(12, 2), (40, 3)]
    src = torch.arange(2 * 64 * 2 * 2 * 4, dtype=torch.float32).view(2, 64, 2, 2, 4)
    limits = FrameLimits(max_payload_bytes=4 * 5 * LAYOUT.slot_bytes)  # five tokens per frame
    sender = TcpSender(LAYOUT, src, {"host": rx.address[0], "port": rx.address[1]}, token="tok", limits=limits)
    try:
        lease(rx, fence=9, blocks=(3, 5, 7), start=1, end=12)
        sent = Lease("r1", 9, [3, 5, 7], BLOCK, 1, 12, 0.0)
        runs = [(20, 6), (50, 5)]  # the prefill side's slots of positions 1..11
        for layer in range(2):
            sender.write(sent, layer, 1, 12, runs)
        sender.notify(sent, 4)
        assert event(rx).kind == EventKind.LANDED
        expected = torch.cat([src[:, 20:26], src[:, 50:55]], dim=1)
        got = torch.cat([rx.kv_cache[:, 13:16], rx.kv_cache[:, 20:24], rx.kv_cache[:, 28:32]], dim=1)
        assert torch.equal(got, expected)
    finally:
        sender.close()


def test_sender_statuses_worst_first(rx):
    from pdserve.kv_transfer.base import TransferStatus
    from pdserve.kv_transfer.tcp import TcpSender

    assert min(TransferStatus) == TransferStatus.FAILED and max(TransferStatus) == TransferStatus.DONE
    src = torch.ones(2, 64, 2, 2, 4)
    sender = TcpSender(LAYOUT, src, {"host": rx.address[0], "port": rx.address[1]}, token="tok")
    try:
        done, aborted, lost = (Lease(f"r{i}", 20 + i, [3, 5], BLOCK, 0, 8, time.monotonic() + 30) for i in range(3))
        for lease_ in (done, aborted, lost):
            rx.open_lease(lease_)
            sender.write(lease_, 0, 0, 8, [(0, 8)])
        assert sender.poll("r0") == TransferStatus.PENDING
        sender.write(done, 1, 0, 8, [(0, 8)])
        sender.notify(done, 1)
        sender.flush()
        assert event(rx).kind == EventKind.LANDED and sender.poll("r0") == TransferStatus.DONE
        rx.close_lease(aborted.fence, "client gone")  # the abort reaches the sender ...
        wait_for(lambda: sender.poll("r1") == TransferStatus.ABORTED, 5, "the sender to see the abort")
        assert event(rx).kind == EventKind.RELEASABLE  # ... and blocks are free
        rx.close()  # the decode side goes away
        wait_for(lambda: sender.poll("r2") == TransferStatus.FAILED, 5, "the sender to see the receiver gone")
    finally:
        sender.close()


def test_a_renewal_keeps_a_paused_prompts_lease_waiting(rx):
    """A prefill worker whose prompt is paused renews its lease: the deadline moves to the lease's
    timeout from now; a renewal of a lease that is not live changes nothing and keeps the link."""
    from pdserve.kv_transfer.codec import RenewHeader
    from pdserve.kv_transfer.tcp import TcpSender

    sock, _ = connect(rx)
    held = Lease("r1", 11, [3, 5], BLOCK, 0, 8, time.monotonic() + 0.5, timeout_s=20.0)
    rx.open_lease(held)
    sock.sendmsg(encode_frame(RenewHeader("r1", 11)))
    sock.sendmsg(encode_frame(RenewHeader("r1", 12)))  # no such lease: ignored
    settle(rx, sock)
    assert held.deadline > time.monotonic() + 19 and rx.leases.num_renewals == 1
    assert rx.expired(time.monotonic() + 1) == []
    sender = TcpSender(LAYOUT, torch.zeros(2, 64, 2, 2, 4), {"host": rx.address[0], "port": rx.address[1]}, token="tok")
    try:
        held.deadline = time.monotonic() + 0.5
        sender.renew(Lease("r1", 11, [3, 5], BLOCK, 0, 8, 0.0))
        sender.flush()
        wait_for(lambda: rx.leases.num_renewals == 2, 5, "the sender's renewal")
        assert held.deadline > time.monotonic() + 19
    finally:
        sender.close()
        sock.close()
