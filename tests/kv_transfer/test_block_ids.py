"""Block ids come from a peer: a negative id or one past the pool never becomes a write into other
requests' blocks, and a prefill worker refuses a lease no decode worker could have made."""

from __future__ import annotations

import queue
import time

import msgspec
import pytest
import torch

from pdserve.kv_transfer.base import Lease, TransferError, TransferStatus, slot_runs
from pdserve.kv_transfer.leases import EventKind
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.kv_transfer.shm import SharedKVPool, ShmSender, shm_available
from pdserve import wire
from pdserve.worker.prefill import MAX_SPARE_BLOCKS, PrefillRole
from tests.kv_transfer.raw_peer import BLOCK, LAYOUT, NUM_BLOCKS, TOKEN, next_event
from tests.wait import wait_for


def test_slot_runs_refuse_negative_block_ids():
    assert slot_runs([3, 4, 9], 4, 2, 10) == [(14, 6), (36, 2)]
    with pytest.raises(TransferError, match="block id -2 .* is negative"):
        slot_runs([3, -2], 4, 0, 8)


@pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm")
@pytest.mark.parametrize("bad_table", [[-2, 3], [3, NUM_BLOCKS], [1 << 40, 3]])
def test_an_in_place_writer_never_writes_outside_the_named_blocks(bad_table):
    shape = (LAYOUT.num_layers, NUM_BLOCKS * BLOCK, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    pool = SharedKVPool(shape, torch.float32)
    rx = KVReceiver(LAYOUT, pool.tensor, queue.Queue(), token=TOKEN)
    src = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + 1
    peer = {"host": rx.address[0], "port": rx.address[1], "path": pool.path, "num_slots": shape[1]}
    refused, sender = ShmSender(LAYOUT, src, peer, token=TOKEN), ShmSender(LAYOUT, src, peer, token=TOKEN)
    try:
        bad = Lease("bad", 11, bad_table, BLOCK, 0, 8, time.monotonic() + 30)
        with pytest.raises(ValueError, match="names slots|negative"):
            refused.check(bad)  # how a prefill worker refuses such a lease: 400
        refused.write(bad, 0, 0, 8, [(0, 8)])  # were it queued anyway, the copy is refused
        wait_for(lambda: refused.poll("bad") == TransferStatus.FAILED, 10, "the refused copy failed")
        assert pool.tensor.abs().sum() == 0  # not a byte landed anywhere

        # the same path with a good table lands, so the refusal above was the ids, nothing else
        good = Lease("good", 12, [2, 6], BLOCK, 0, 8, time.monotonic() + 30)
        rx.open_lease(Lease("good", 12, [2, 6], BLOCK, 0, 8, time.monotonic() + 30))
        sender.check(good)
        sender.prepare(good)
        for layer in range(LAYOUT.num_layers):
            sender.write(good, layer, 0, 8, [(0, 8)])
        sender.notify(good, 3)
        assert next_event(rx).kind == EventKind.LANDED
        assert torch.equal(pool.tensor[:, 8:12], src[:, 0:4]) and torch.equal(pool.tensor[:, 24:28], src[:, 4:8])
        assert pool.tensor.abs().sum() == src[:, :8].abs().sum()
    finally:
        refused.close()
        sender.close()
        rx.close()
        pool.close()


def lease_body(**changes) -> dict:
    body = {"request_id": "r1", "fence": 7, "prompt_token_ids": list(range(10)), "output_token_ids": [],
            "sampling": {}, "start": 0, "block_table": [4, 5, 6], "block_size": 4,
            "model_hash": LAYOUT.model_hash, "decode": {}}
    return {**body, **changes}


@pytest.fixture
def prefill():
    role = PrefillRole({}, ["tcp"])
    role.layout = LAYOUT
    return role


def accept(role: PrefillRole, body: dict):
    """As the worker's /v1/prefill takes a lease: the message decoded at the edge, then accepted."""
    return role.accept(wire.decode(msgspec.json.encode(body), wire.PrefillLease))


# The message's bounds refuse some (`wire.BadMessage` naming the field); the prefill role refuses
# the rest, which only make no sense together (a table too short for the sequence).
@pytest.mark.parametrize("changes, message", [
    ({"block_table": [4, -1, 6]}, r"block_table\.1: Expected `int` >= 0"),
    ({"block_table": [4, 5]}, "has 2 blocks; a sequence of 10 tokens in blocks of 4 needs 3"),
    ({"block_table": [4, 5, 6] + [7] * (MAX_SPARE_BLOCKS + 1)}, f"at most {MAX_SPARE_BLOCKS} more"),
    ({"block_size": 3}, "not a power of two"),
    ({"block_size": 0}, "block_size: Expected `int` >= 1"),
    ({"block_size": 2 * wire.MAX_BLOCK_SIZE, "block_table": [1]}, f"block_size: Expected `int` <= {wire.MAX_BLOCK_SIZE}"),
    ({"start": 10}, "lease start 10 outside the sequence of 10 tokens"),
    ({"start": -1}, "start: Expected `int` >= 0"),
    ({"fence": -1}, "fence: Expected `int` >= 0"),
    ({"fence": 1 << 63}, "fence: Expected `int` <="),
    ({"draft_block_table": [4, 5]}, "draft_block_table has 2 blocks; a sequence of 10 tokens in blocks of 4 needs 3"),
    ({"draft_block_table": [1, -2, 3]}, r"draft_block_table\.1: Expected `int` >= 0"),
    ({"draft_hash": "h" * 129}, "draft_hash: Expected `str` of length <= 128"),
])
def test_a_lease_no_decode_worker_could_make_is_refused(prefill, changes, message):
    with pytest.raises(ValueError, match=message):
        accept(prefill, lease_body(**changes))


def test_a_sound_lease_passes_the_checks(prefill):
    # with no backend offered, it gets as far as choosing one
    with pytest.raises(TransferError, match="no KV transfer backend"):
        accept(prefill, lease_body(block_table=[4, 5, 6, 9], output_token_ids=[3, 3]))
