"""A draft model's KV in the same lease as the target's (`DraftKV`): its layers follow the target's
on the wire, land in the decode worker's draft cache through the blocks the lease names for it,
travel raw even beside in-place writers, and never mix with the target's."""

from __future__ import annotations

import queue
import time
from contextlib import contextmanager

import pytest
import torch

from pdserve.kv_transfer.base import DraftKV, KVLayout, Lease
from pdserve.kv_transfer.codec import FrameLimits, NotifyHeader, WriteHeader, encode_frame
from pdserve.kv_transfer.receiver import EventKind, KVReceiver
from pdserve.kv_transfer.shm import SharedKVPool, shm_available
from tests.kv_transfer.test_receiver import connect, settle

LAYOUT = KVLayout("m" * 64, num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")
DRAFT = KVLayout("d" * 64, num_layers=3, num_kv_heads=1, head_dim=8, dtype="float32")
BLOCK, SLOTS = 4, 64


def cache(layout: KVLayout, fill: float | None = None) -> torch.Tensor:
    shape = (layout.num_layers, SLOTS, 2, layout.num_kv_heads, layout.head_dim)
    if fill is None:
        return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    return torch.full(shape, fill)


def receiver(target: torch.Tensor) -> KVReceiver:
    return KVReceiver(LAYOUT, target, queue.Queue(), token="tok", limits=FrameLimits(max_payload_bytes=1 << 16),
                      draft=DraftKV(DRAFT, cache(DRAFT, 0.0)))


@contextmanager
def connected():
    """A receiver with a draft cache, and a raw peer's socket to it, closed after."""
    rx = receiver(cache(LAYOUT, 0.0))
    sock, _ = connect(rx)
    try:
        yield rx, sock
    finally:
        sock.close()
        rx.close()


def open_lease(rx: KVReceiver, fence: int, start: int = 4, end: int = 10, draft: bool = True) -> Lease:
    lease = Lease("r1", fence, [3, 5, 7], BLOCK, start, end, time.monotonic() + 30,
                  draft_block_table=[9, 2, 11] if draft else [])
    rx.open_lease(lease)
    return lease


@pytest.mark.parametrize("backend", ["tcp", pytest.param("shm", marks=pytest.mark.skipif(
    not shm_available(), reason="no writable /dev/shm"))])
def test_the_draft_layers_land_in_the_draft_cache_beside_the_target(backend):
    from pdserve.kv_transfer.shm import ShmSender
    from pdserve.kv_transfer.tcp import TcpSender

    pool = SharedKVPool((LAYOUT.num_layers, SLOTS, 2, 2, 4), torch.float32) if backend == "shm" else None
    rx = receiver(pool.tensor if pool else cache(LAYOUT, 0.0))
    src, draft_src = cache(LAYOUT), cache(DRAFT) + 0.5
    peer = {"host": rx.address[0], "port": rx.address[1]}
    if pool:
        peer |= {"path": pool.path, "num_slots": SLOTS}
    sender = (ShmSender if pool else TcpSender)(LAYOUT, src, peer, token="tok", draft=DraftKV(DRAFT, draft_src))
    try:
        lease = open_lease(rx, fence=21)
        sent = Lease("r1", 21, [3, 5, 7], BLOCK, 4, 10, 0.0, draft_block_table=[9, 2, 11])
        sender.prepare(sent)
        target_runs, draft_runs = [(40, 6)], [(0, 4), (20, 6)]  # this side's slots
        for layer in range(LAYOUT.num_layers):
            sender.write(sent, layer, 4, 10, target_runs)
        for layer in range(DRAFT.num_layers):  # numbered after the target's; from position 0
            sender.write(sent, LAYOUT.num_layers + layer, 0, 10, draft_runs)
        sender.notify(sent, 5)
        ev = rx.events.get(timeout=5)
        assert ev.kind == EventKind.LANDED and lease.complete and lease.draft_complete
        draft = rx.draft.cache
        got = torch.cat([draft[:, 36:40], draft[:, 8:12], draft[:, 44:46]], dim=1)  # blocks 9, 2, 11
        assert torch.equal(got, torch.cat([draft_src[:, 0:4], draft_src[:, 20:26]], dim=1))
        assert draft.count_nonzero() == got.count_nonzero()  # nothing outside the lease's draft blocks
        target = rx.kv_cache
        assert torch.equal(torch.cat([target[:, 20:24], target[:, 28:30]], dim=1), src[:, 40:46])
    finally:
        sender.close()
        rx.close()
        if pool:
            pool.close()


def test_a_lease_may_land_without_its_draft_kv():
    with connected() as (rx, sock):
        lease = open_lease(rx, fence=3, start=0, end=4)
        for layer in range(LAYOUT.num_layers):
            sock.sendmsg(encode_frame(WriteHeader("r1", 3, layer, 0, 4), bytes(4 * LAYOUT.slot_bytes)))
        sock.sendmsg(encode_frame(NotifyHeader("r1", 3, first_token=1, num_prompt_tokens=4)))
        assert rx.events.get(timeout=5).kind == EventKind.LANDED
        assert lease.complete and not lease.draft_complete  # the decode worker's draft computes it


@pytest.mark.parametrize("header,size,draft", [
    (WriteHeader("r1", 4, 2, 0, 4, "int8"), 4 * 2 * 8 + 4 * 2 * 4, True),  # draft KV travels raw
    (WriteHeader("r1", 4, 1, 0, 4, num_layers=2), 4 * LAYOUT.slot_bytes + 4 * DRAFT.slot_bytes, True),  # both
    (WriteHeader("r1", 4, 5, 0, 4), 4 * DRAFT.slot_bytes, True),  # past the draft's layers
    (WriteHeader("r1", 4, 2, 0, 4), 4 * DRAFT.slot_bytes, False),  # a lease that takes no draft KV
    (WriteHeader("r1", 4, 2, 4, 4), 4 * DRAFT.slot_bytes, True),  # a gap: positions 0-3 not yet written
    (WriteHeader("r1", 4, 2, 0, 4, "direct"), 0, True),  # nobody writes a draft cache in place
])
def test_bad_draft_writes_drop_the_connection_and_land_nowhere(header, size, draft):
    with connected() as (rx, sock):
        open_lease(rx, fence=4, start=0, end=8, draft=draft)
        sock.sendmsg(encode_frame(header, bytes(size)))
        sock.settimeout(5)
        try:
            assert sock.recv(100) == b""
        except ConnectionResetError:
            pass
        assert rx.draft.cache.count_nonzero() == 0 and rx.kv_cache.count_nonzero() == 0
        assert rx.num_open_leases == 1  # no peer bound it: another may still fill it


def test_a_good_draft_write_keeps_the_connection():
    with connected() as (rx, sock):
        lease = open_lease(rx, fence=4, start=0, end=8)
        data = torch.ones(4, 2, 1, 8).numpy().tobytes()
        sock.sendmsg(encode_frame(WriteHeader("r1", 4, 3, 0, 4), data))
        settle(rx, sock)
        assert lease.draft_received == [0, 4, 0] and rx.draft.cache[1, 36:40].eq(1).all()
