"""A peer can end or claim only the lease it names by request id and fence, bound to it if bound at
all; fences are random, so naming another request's lease takes more than counting."""

from __future__ import annotations

import time

import pytest

from pdserve.kv_transfer.codec import AbortHeader, AckHeader, ClaimHeader, NotifyHeader, WriteHeader
from pdserve.kv_transfer.leases import EventKind
from pdserve.kv_transfer.listener import PeerLimits
from pdserve.worker import decode as decode_module
from pdserve.worker.decode import DecodeRole, holder_id
from tests.kv_transfer.fake_engine import FakeEngine, FakeRequest
from tests.kv_transfer.raw_peer import (
    connect, kv_data, make_receiver, next_event, open_lease, receive, send, settle,
)
from tests.wait import wait_for


@pytest.fixture
def rx():
    receiver = make_receiver()
    yield receiver
    receiver.close()


def test_abort_must_name_both_the_request_and_the_fence(rx):
    sock = connect(rx)
    lease, other = open_lease(rx), open_lease(rx, blocks=(7, 8), request_id="r2")
    send(sock, AbortHeader("r2", lease.fence, "wrong request"))
    send(sock, AbortHeader(lease.request_id, lease.fence ^ 1, "wrong fence"))
    settle(sock)
    assert rx.events.empty() and rx.num_open_leases == 2
    send(sock, AbortHeader(lease.request_id, lease.fence, "prefill failed"))
    assert [(e.kind, e.fence) for e in (next_event(rx), next_event(rx))] == [
        (EventKind.FAILED, lease.fence), (EventKind.RELEASABLE, lease.fence)]
    assert rx.num_open_leases == 1  # the other request's lease lives on
    rx.close_lease(other.fence, "done")
    sock.close()


def test_only_the_bound_writer_ends_its_lease(rx):
    writer, stranger = connect(rx), connect(rx)
    lease = open_lease(rx)
    send(writer, ClaimHeader(lease.request_id, lease.fence))
    assert receive(writer).ok
    send(stranger, ClaimHeader(lease.request_id, lease.fence))
    assert "bound to another peer" in receive(stranger).error
    send(stranger, AbortHeader(lease.request_id, lease.fence, "not mine"))
    send(stranger, NotifyHeader(lease.request_id, lease.fence, 1, 8))
    settle(stranger)
    assert rx.events.empty() and rx.num_open_leases == 1

    rx.close_lease(lease.fence, "client gone")
    assert receive(writer).fence == lease.fence  # the abort goes to the writer alone
    send(stranger, AckHeader(lease.request_id, lease.fence, ok=True))  # not the writer's acknowledgement
    send(writer, AckHeader("r2", lease.fence, ok=True))  # not this lease's
    settle(stranger)
    settle(writer)
    assert rx.events.empty()  # the blocks stay pinned until the writer itself acknowledges
    send(writer, AckHeader(lease.request_id, lease.fence, ok=True))
    assert next_event(rx).kind == EventKind.RELEASABLE
    writer.close()
    stranger.close()


def test_claim_write_and_notify_need_the_right_request(rx):
    sock = connect(rx)
    lease = open_lease(rx)
    send(sock, ClaimHeader("r2", lease.fence))
    assert not receive(sock).ok
    send(sock, WriteHeader("r2", lease.fence, 0, 0, 8), kv_data(8, 1))
    for layer in range(2):
        send(sock, WriteHeader(lease.request_id, lease.fence, layer, 0, 8), kv_data(8, layer + 1))
    send(sock, NotifyHeader("r2", lease.fence, 5, 8))
    settle(sock)
    assert rx.events.empty() and rx.num_stale_writes == 1
    send(sock, NotifyHeader(lease.request_id, lease.fence, 5, 8))
    assert next_event(rx).kind == EventKind.LANDED
    sock.close()


def test_a_notify_that_contradicts_the_lease_fails_it(rx):
    sock = connect(rx)
    lease = open_lease(rx)
    for layer in range(2):
        send(sock, WriteHeader(lease.request_id, lease.fence, layer, 0, 8), kv_data(8, 1))
    send(sock, NotifyHeader(lease.request_id, lease.fence, first_token=-3, num_prompt_tokens=8))
    ev = next_event(rx)
    assert ev.kind == EventKind.FAILED and "bad notify" in ev.reason
    assert next_event(rx).kind == EventKind.RELEASABLE
    sock.close()


@pytest.fixture
def role():
    role = DecodeRole()
    yield role
    role.close()


def test_fences_are_random_and_unique(role):
    fences = [role._new_fence() for _ in range(1000)]
    assert len(set(fences)) == 1000 and all(0 < f < 1 << 62 for f in fences)
    assert sum(1 for a, b in zip(fences, fences[1:]) if b == a + 1) == 0  # not a counter


def test_a_fence_in_use_is_never_drawn_again(role, monkeypatch):
    draws = iter([5, 5, 0, 7])
    monkeypatch.setattr(decode_module.secrets, "randbits", lambda bits: next(draws))
    assert [role._new_fence(), role._new_fence()] == [5, 7]


def test_the_decode_loop_cuts_off_a_writer_that_never_acknowledges(role):
    rx = make_receiver(peers=PeerLimits(release_grace_s=0.2))
    try:
        engine = FakeEngine()
        role.attach(engine, rx, {}, lambda fn: fn())
        sock = connect(rx)
        lease = open_lease(rx)
        role.leases[lease.request_id] = lease
        send(sock, ClaimHeader(lease.request_id, lease.fence))
        assert receive(sock).ok
        role.on_finished(FakeRequest(lease.request_id))  # aborted while the KV was on its way
        assert engine.block_manager.holders == {holder_id(lease.fence)}
        receive(sock)  # the abort, never acknowledged

        def released() -> bool:
            role.poll()  # one turn of the engine loop
            time.sleep(0.02)
            return not engine.block_manager.holders
        wait_for(released, 10, "the blocks released")
        assert rx.num_forced_disconnects == 1 and role.stats()["kv_forced_disconnects"] == 1
        sock.close()
    finally:
        rx.close()


@pytest.mark.parametrize("first_token, landed", [(99, True), (100, False)])
def test_a_first_token_outside_the_vocabulary_is_recomputed_instead(role, first_token, landed):
    rx = make_receiver()
    try:
        engine = FakeEngine()
        role.attach(engine, rx, {}, lambda fn: fn())
        sock = connect(rx)
        lease = open_lease(rx)
        role.leases[lease.request_id] = lease
        for layer in range(2):
            send(sock, WriteHeader(lease.request_id, lease.fence, layer, 0, 8), kv_data(8, 1))
        send(sock, NotifyHeader(lease.request_id, lease.fence, first_token, 8))
        wait_for(lambda: (role.poll(), engine.landed or engine.recomputed)[1], 10, "the KV landed or recomputed")
        assert engine.landed == ([(lease.request_id, first_token)] if landed else [])
        assert engine.recomputed == ([] if landed else [lease.request_id])
        assert not engine.block_manager.holders  # either way no holder keeps the blocks
        sock.close()
    finally:
        rx.close()
