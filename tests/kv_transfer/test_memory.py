"""The in-process backend: KV lands in the decode cache and every lease transition goes through the
real lease table, without a socket; it never reaches across processes."""

from __future__ import annotations

import os
import queue
import time

import pytest
import torch

from pdserve.kv_transfer.base import KVLayout, LayoutMismatch, Lease, ModelMismatch, TransferError, TransferStatus
from pdserve.kv_transfer.leases import EventKind, LeaseTable
from pdserve.kv_transfer.memory import MemorySender, publish, withdraw
from pdserve.kv_transfer.registry import BACKENDS, PRODUCTION_BACKENDS, sender_types
from pdserve.worker.decode import DecodeRole
from tests.kv_transfer.raw_peer import BLOCK, LAYOUT, NUM_BLOCKS, TOKEN, make_receiver
from tests.kv_transfer.fake_engine import FakeEngine

SHAPE = (LAYOUT.num_layers, NUM_BLOCKS * BLOCK, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim)


class Decode:
    """A decode worker's KV side, as the memory backend sees it: a cache and its lease table."""

    def __init__(self, token: str = TOKEN, release_grace_s: float = 10.0) -> None:
        self.kv_cache = torch.zeros(SHAPE)
        self.events: queue.Queue = queue.Queue()
        self.leases = LeaseTable(self.events, release_grace_s)
        self.offer = publish(LAYOUT, self.kv_cache, self.leases, token)

    def open(self, fence: int, blocks=(3, 5), start: int = 0, end: int = 8, request_id: str = "r1",
             deadline_s: float = 30.0) -> Lease:
        lease = Lease(request_id, fence, list(blocks), BLOCK, start, end, time.monotonic() + deadline_s)
        self.leases.open(lease, LAYOUT.num_layers)
        return lease

    def kinds(self) -> list[EventKind]:
        out = []
        while not self.events.empty():
            out.append(self.events.get_nowait().kind)
        return out


@pytest.fixture
def decode():
    d = Decode()
    yield d
    withdraw(d.kv_cache)


def source() -> torch.Tensor:
    return torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE) + 1


def sender(decode: Decode, aborts: list | None = None, **kw) -> MemorySender:
    on_abort = (lambda rid, fence: aborts.append((rid, fence))) if aborts is not None else (lambda rid, fence: None)
    return MemorySender(LAYOUT, kw.pop("src", None) if "src" in kw else source(), decode.offer, token=TOKEN,
                        on_peer_abort=on_abort, **kw)


def ship(s: MemorySender, lease: Lease, src_runs=((0, 8),), first_token: int = 5) -> None:
    s.check(lease)
    s.prepare(lease)
    for layer in range(LAYOUT.num_layers):
        s.write(lease, layer, lease.start, lease.end, list(src_runs))
    s.notify(lease, first_token, (0.25, 0.5))


def test_writes_land_in_the_leased_blocks_and_notify_lands_the_lease(decode):
    s = sender(decode)
    lease = decode.open(fence=7)
    ship(s, lease, src_runs=[(20, 6), (40, 2)])
    event = decode.events.get_nowait()
    assert (event.kind, event.first_token, event.prefill_times) == (EventKind.LANDED, 5, (0.25, 0.5))
    src = source()
    expected = torch.cat([src[:, 20:26], src[:, 40:42]], dim=1)
    assert torch.equal(torch.cat([decode.kv_cache[:, 12:16], decode.kv_cache[:, 20:24]], dim=1), expected)
    assert decode.kv_cache.abs().sum() == expected.abs().sum()  # nothing outside the lease's blocks
    assert decode.leases.bytes_received == s.bytes_sent == 8 * LAYOUT.slot_bytes * LAYOUT.num_layers
    assert s.poll("r1") == TransferStatus.DONE and decode.leases.num_open == 0


@pytest.mark.parametrize("encoding", ["int8", "fp8"])
def test_quantized_writes_land_close_to_the_source(decode, encoding):
    s = sender(decode, encoding=encoding)
    ship(s, decode.open(fence=3))
    assert decode.events.get_nowait().kind == EventKind.LANDED
    src = source()[:, :8]
    got = torch.cat([decode.kv_cache[:, 12:16], decode.kv_cache[:, 20:24]], dim=1)
    # fp8 e4m3 keeps 3 mantissa bits: a relative error of at most 2**-4 (6.25%) per value after the
    # per-block scale; int8 is far inside that. 0.07 is that bound, not a figure read off a run.
    assert torch.allclose(got, src, rtol=0.07, atol=0.0)


def test_an_offer_from_another_process_is_refused(decode):
    with pytest.raises(TransferError, match="within one process"):
        MemorySender(LAYOUT, source(), {**decode.offer, "pid": os.getpid() + 1}, token=TOKEN)
    with pytest.raises(TransferError, match="no KV endpoint"):
        MemorySender(LAYOUT, source(), {**decode.offer, "endpoint": "elsewhere"}, token=TOKEN)


def test_the_handshake_refuses_a_bad_token_and_another_model(decode):
    with pytest.raises(TransferError, match="bad token"):
        MemorySender(LAYOUT, source(), decode.offer, token="wrong")
    other_model = KVLayout("x" * 64, LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.dtype)
    with pytest.raises(ModelMismatch, match="refused the KV connection: model mismatch"):
        MemorySender(other_model, source(), decode.offer, token=TOKEN)
    other_dtype = KVLayout(LAYOUT.model_hash, LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, "float16")
    with pytest.raises(LayoutMismatch, match="KV dtype mismatch: .* the peer in float16; give every worker the same --dtype"):
        MemorySender(other_dtype, source(), decode.offer, token=TOKEN)
    other_heads = KVLayout(LAYOUT.model_hash, LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim * 2, LAYOUT.dtype)
    with pytest.raises(LayoutMismatch, match="KV layout mismatch"):
        MemorySender(other_heads, source(), decode.offer, token=TOKEN)


def test_a_decode_abort_reaches_the_sender_and_frees_the_blocks(decode):
    aborts: list = []
    s = sender(decode, aborts)
    lease = decode.open(fence=11)
    s.prepare(lease)
    s.write(lease, 0, 0, 8, [(0, 8)])
    assert decode.leases.close(11, "client gone")
    assert aborts == [("r1", 11)] and s.poll("r1") == TransferStatus.ABORTED
    assert decode.kinds() == [EventKind.RELEASABLE]  # the in-place writer acknowledged: blocks are free
    landed = decode.kv_cache.clone()
    s.write(lease, 1, 0, 8, [(0, 8)])  # late: nothing more goes to the lease
    s.notify(lease, 1)
    assert torch.equal(decode.kv_cache, landed) and decode.events.empty()
    s.forget(lease)


def test_a_prefill_abort_fails_the_lease(decode):
    s = sender(decode)
    lease = decode.open(fence=12)
    s.prepare(lease)
    s.write(lease, 0, 0, 8, [(0, 8)])
    s.abort(lease, "prefill ended: abort")
    event = decode.events.get_nowait()
    assert (event.kind, event.reason) == (EventKind.FAILED, "prefill aborted: prefill ended: abort")
    assert decode.kinds() == [EventKind.RELEASABLE] and s.poll("r1") == TransferStatus.ABORTED


def test_a_lease_must_match_by_request_and_fence(decode):
    s, guesser = sender(decode), sender(decode)
    lease = decode.open(fence=21)
    s.write(Lease("r1", 20, [3, 5], BLOCK, 0, 8, 0.0), 0, 0, 8, [(0, 8)])  # an older lease: claim refused
    ship(guesser, Lease("r2", 21, [3, 5], BLOCK, 0, 8, 0.0))  # another request naming this fence
    assert decode.kv_cache.abs().sum() == 0 and decode.events.empty() and s.alive and guesser.alive
    ship(s, lease)  # the right lease still lands
    assert decode.kinds() == [EventKind.LANDED]


def test_a_lease_bound_to_one_sender_is_refused_to_another(decode):
    writer, stranger = sender(decode), sender(decode, src=torch.full(SHAPE, 9.0))
    lease = decode.open(fence=31)
    writer.prepare(lease)
    stranger.prepare(lease)
    stranger.write(lease, 0, 0, 8, [(0, 8)])
    stranger.notify(lease, 1)
    assert decode.kv_cache.abs().sum() == 0 and decode.events.empty()
    ship(writer, lease)
    assert decode.kinds() == [EventKind.LANDED]


def test_notify_before_every_layer_landed_fails_the_lease(decode):
    s = sender(decode)
    lease = decode.open(fence=41)
    s.prepare(lease)
    s.write(lease, 0, 0, 8, [(0, 8)])
    s.notify(lease, 5)
    assert decode.kinds() == [EventKind.FAILED, EventKind.RELEASABLE]


def test_an_expired_lease_is_found_and_closing_it_releases_the_blocks(decode):
    s = sender(decode)
    lease = decode.open(fence=51, deadline_s=-1.0)
    s.prepare(lease)
    s.write(lease, 0, 0, 8, [(0, 8)])
    assert decode.leases.expired(time.monotonic()) == [lease]
    assert decode.leases.close(51, "KV transfer timed out")
    assert decode.kinds() == [EventKind.RELEASABLE]
    assert decode.leases.expired(time.monotonic()) == []


def test_a_closed_sender_fails_its_requests_on_both_sides(decode):
    aborts: list = []
    s = sender(decode, aborts)
    lease = decode.open(fence=61)
    s.prepare(lease)
    s.write(lease, 0, 0, 8, [(0, 8)])
    s.close()
    assert not s.alive and aborts == [("r1", None)] and s.poll("r1") == TransferStatus.FAILED
    assert decode.kinds() == [EventKind.FAILED, EventKind.RELEASABLE]
    later = Lease("r2", 62, [7], BLOCK, 0, 4, 0.0)
    s.write(later, 0, 0, 4, [(0, 4)])
    assert s.poll("r2") == TransferStatus.FAILED


def test_withdrawing_the_cache_cuts_its_senders_off(decode):
    aborts: list = []
    s = sender(decode, aborts)
    lease = decode.open(fence=71)
    s.prepare(lease)
    s.write(lease, 0, 0, 8, [(0, 8)])
    withdraw(decode.kv_cache)
    assert not s.alive and aborts == [("r1", None)]
    assert decode.kinds() == [EventKind.FAILED, EventKind.RELEASABLE]
    with pytest.raises(TransferError, match="no KV endpoint"):
        sender(decode)


def test_memory_is_never_a_production_backend():
    assert "memory" in BACKENDS and "memory" not in PRODUCTION_BACKENDS
    assert set(sender_types(["shm", "tcp"])) <= {"shm", "tcp"}  # the default list never reaches it
    assert sender_types(["memory"]) == {"memory": MemorySender}


# -- the decode worker's side of a lease, over the in-process backend ---------------------------

@pytest.fixture
def role():
    role = DecodeRole()
    yield role
    role.close()


@pytest.fixture
def rx():
    receiver = make_receiver()
    yield receiver
    withdraw(receiver.kv_cache)
    receiver.close()


def leased(role: DecodeRole, rx, fence: int, deadline_s: float = 30.0) -> Lease:
    lease = Lease("r1", fence, [3, 5], BLOCK, 0, 8, time.monotonic() + deadline_s)
    rx.open_lease(lease)
    role.leases[lease.request_id] = lease
    return lease


@pytest.mark.parametrize("first_token, landed", [(99, True), (100, False)])
def test_the_decode_role_admits_landed_kv_and_recomputes_past_the_vocabulary(role, rx, first_token, landed):
    engine = FakeEngine()
    role.attach(engine, rx, {}, lambda fn: fn())
    s = MemorySender(LAYOUT, source(), publish(LAYOUT, rx.kv_cache, rx.leases, TOKEN), token=TOKEN)
    ship(s, leased(role, rx, fence=81), first_token=first_token)
    role.poll()  # one turn of the engine loop: the events are already there
    assert engine.landed == ([("r1", first_token)] if landed else [])
    assert engine.recomputed == ([] if landed else ["r1"])
    assert not engine.block_manager.holders  # either way no holder keeps the blocks
    assert role.stats()["kv_bytes_received"] == s.bytes_sent == 8 * LAYOUT.slot_bytes * LAYOUT.num_layers


def test_a_lease_past_its_deadline_is_recomputed_and_its_blocks_freed_once_the_writer_stops(role, rx):
    engine = FakeEngine()
    role.attach(engine, rx, {}, lambda fn: fn())
    aborts: list = []
    s = MemorySender(LAYOUT, source(), publish(LAYOUT, rx.kv_cache, rx.leases, TOKEN), token=TOKEN,
                     on_peer_abort=lambda rid, fence: aborts.append((rid, fence)))
    lease = leased(role, rx, fence=91, deadline_s=-1.0)
    s.prepare(lease)  # claimed: decode must wait for this writer before reusing the blocks
    s.write(lease, 0, 0, 8, [(0, 8)])
    role.poll()  # the deadline passed: the request recomputes, the blocks go to a holder
    assert engine.recomputed == ["r1"] and aborts == [("r1", 91)]
    assert s.poll("r1") == TransferStatus.ABORTED and rx.num_open_leases == 0
    role.poll()  # the writer acknowledged the abort: the holder lets the blocks go
    assert not engine.block_manager.holders
    s.write(lease, 1, 0, 8, [(0, 8)])
    s.notify(lease, 4)  # late: the lease is gone
    role.poll()
    assert engine.landed == [] and rx.events.empty()
