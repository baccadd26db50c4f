"""Decode-side admission by reservation, without a model: blocks for the whole prompt plus
headroom, prefix hits not reserved twice, KV landing or failing, aborts, no overcommit."""

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import RequestStatus
from pdserve.engine.role import RoleHooks
from pdserve.engine.scheduler import Scheduler
from tests.factories import assert_no_leaks, make_request, run_fake_step


class Recorder(RoleHooks):
    def __init__(self):
        self.reserved = []

    def on_reserved(self, request):
        self.reserved.append(request.request_id)


def scheduler(num_blocks=16, headroom=8, max_num_seqs=16):
    hooks = Recorder()
    return Scheduler(BlockManager(num_blocks, 4), 64, max_num_seqs, hooks=hooks, headroom_tokens=headroom), hooks


def remote(**kw):
    req = make_request(**kw)
    req.remote_prefill = True
    return req


def test_reservation_covers_the_prompt_and_then_the_kv_lands():
    sched, hooks = scheduler()
    req = remote(num_prompt_tokens=10, max_tokens=3)
    sched.add(req)
    out = sched.schedule()
    assert out.empty and req.status == RequestStatus.WAITING_FOR_KV and hooks.reserved == [req.request_id]
    assert len(sched.blocks.block_table(req.request_id)) == 3  # 10 tokens, blocks of 4
    assert sched.kv_landed(req.request_id, first_token=7) is req
    assert req.status == RequestStatus.RUNNING and req.output_token_ids == [7]
    assert req.num_computed_tokens == 10
    run_fake_step(sched)
    run_fake_step(sched)
    assert req.status == RequestStatus.FINISHED_LENGTH and len(req.output_token_ids) == 3
    assert_no_leaks(sched.blocks)


def test_headroom_holds_back_admission_instead_of_overcommitting():
    sched, hooks = scheduler(num_blocks=8, headroom=8)  # 32 slots
    first, second = remote(num_prompt_tokens=16), remote(num_prompt_tokens=16)
    sched.add(first)
    sched.add(second)
    sched.schedule()
    # the first takes 4 blocks; the second's 4 plus 2 of headroom do not fit in the 4 left
    assert first.status == RequestStatus.WAITING_FOR_KV and second.status == RequestStatus.WAITING
    sched.finish(first.request_id, RequestStatus.FINISHED_ABORTED)
    sched.schedule()
    assert second.status == RequestStatus.WAITING_FOR_KV
    sched.finish(second.request_id, RequestStatus.FINISHED_ABORTED)
    assert_no_leaks(sched.blocks)


def test_prefix_hit_is_not_reserved_again():
    sched, _ = scheduler()
    first = make_request(prompt=list(range(1, 13)), max_tokens=1)
    sched.add(first)
    run_fake_step(sched)  # computed here; its 3 full blocks go to the prefix cache
    second = remote(prompt=list(range(1, 13)) + [50, 51, 52], max_tokens=2)
    sched.add(second)
    sched.schedule()
    assert second.num_computed_tokens == 12 and second.num_cached_tokens == 12  # only 3 tokens to receive
    sched.finish(second.request_id, RequestStatus.FINISHED_ABORTED)
    assert_no_leaks(sched.blocks)


def test_failed_transfer_recomputes_locally():
    sched, _ = scheduler()
    req = remote(num_prompt_tokens=9, max_tokens=2)
    sched.add(req)
    sched.schedule()
    sched.kv_failed(req.request_id)
    assert req.status == RequestStatus.PREEMPTED and not req.remote_prefill
    for _ in range(5):
        run_fake_step(sched)
    assert req.status == RequestStatus.FINISHED_LENGTH and len(req.output_token_ids) == 2
    assert_no_leaks(sched.blocks)


def test_landing_after_abort_is_ignored_and_first_token_may_finish():
    sched, _ = scheduler()
    a, b = remote(num_prompt_tokens=5, max_tokens=1), remote(num_prompt_tokens=5, max_tokens=1)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(a.request_id, RequestStatus.FINISHED_ABORTED)
    assert sched.kv_landed(a.request_id, 3) is None
    assert sched.kv_landed(b.request_id, 3) is b and b.status == RequestStatus.FINISHED_LENGTH
    assert_no_leaks(sched.blocks)


def test_reservations_count_against_max_num_seqs():
    sched, _ = scheduler(num_blocks=64, max_num_seqs=2)
    reqs = [remote(num_prompt_tokens=4) for _ in range(3)]
    for r in reqs:
        sched.add(r)
    sched.schedule()
    assert [r.status for r in reqs].count(RequestStatus.WAITING_FOR_KV) == 2
    for r in reqs:
        sched.finish(r.request_id, RequestStatus.FINISHED_ABORTED)
    assert_no_leaks(sched.blocks)


def test_a_landed_request_preempted_later_recomputes_here():
    sched, hooks = scheduler(num_blocks=16, headroom=0)
    req = remote(num_prompt_tokens=8, max_tokens=6)
    sched.add(req)
    sched.schedule()
    sched.kv_landed(req.request_id, 3)
    sched._preempt(req)
    for _ in range(20):
        run_fake_step(sched)
    assert req.status == RequestStatus.FINISHED_LENGTH and hooks.reserved == [req.request_id]
    assert_no_leaks(sched.blocks)


def test_a_prompt_whose_headroom_the_pool_cannot_hold_is_still_reserved_when_the_pool_is_free():
    """A prompt that fits the pool, but not with the headroom on top (a request moved here whole by
    hot-spot relief, near the pool's size), is reserved once nothing else holds blocks: waiting for
    room that can never come would hold every request behind it forever."""
    sched, hooks = scheduler(num_blocks=8, headroom=8)  # 32 slots
    big, after = remote(num_prompt_tokens=30, max_tokens=2), remote(num_prompt_tokens=4)
    sched.add(big)
    sched.add(after)
    sched.schedule()
    assert big.status == RequestStatus.WAITING_FOR_KV and len(sched.blocks.block_table(big.request_id)) == 8
    assert after.status == RequestStatus.WAITING  # no room left: it waits for the big one
    assert sched.kv_landed(big.request_id, first_token=7) is big
    run_fake_step(sched)
    assert big.status == RequestStatus.FINISHED_LENGTH
    sched.schedule()
    assert after.status == RequestStatus.WAITING_FOR_KV
    sched.finish(after.request_id, RequestStatus.FINISHED_ABORTED)
    assert_no_leaks(sched.blocks)
