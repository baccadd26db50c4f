"""The scheduler on its own: no model, tokens 'sampled' by the test, leaks checked after each case."""

from pdserve.engine.request import RequestStatus
from tests.factories import assert_no_leaks, make_request, make_scheduler, run_fake_step


def drain(sched, limit=1000):
    for _ in range(limit):
        if not sched.has_unfinished():
            return
        run_fake_step(sched)
    raise AssertionError("scheduler did not finish its requests")


def test_continuous_batching_requests_join_and_leave():
    sched = make_scheduler()
    a = make_request(num_prompt_tokens=5, max_tokens=2)
    sched.add(a)
    run_fake_step(sched)
    b = make_request(num_prompt_tokens=3, max_tokens=4)
    sched.add(b)
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == [a.request_id, b.request_id]
    assert out.num_new_tokens == [1, 3] and out.num_decodes == 1
    sched.update(out, [5, 5])
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert len(a.output_token_ids) == 2
    drain(sched)
    assert b.status == RequestStatus.FINISHED_LENGTH and len(b.output_token_ids) == 4
    assert_no_leaks(sched.blocks)


def test_chunked_prefill_respects_token_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    long = make_request(num_prompt_tokens=20, max_tokens=1)
    short = make_request(num_prompt_tokens=3, max_tokens=3)
    sched.add(long)
    sched.add(short)
    out = sched.schedule()
    assert out.num_new_tokens == [8] and out.requests == [long]
    sched.update(out, [None])
    assert long.num_computed_tokens == 8 and long.output_token_ids == []
    out = sched.schedule()
    assert out.total_tokens <= 8
    sched.update(out, [5 if r.num_computed_tokens + n == r.num_tokens else None
                       for r, n in zip(out.requests, out.num_new_tokens)])
    drain(sched)
    assert long.output_token_ids == [5]
    assert_no_leaks(sched.blocks)


def test_priority_orders_admission():
    sched = make_scheduler(max_num_seqs=1)
    low = make_request(priority=5, max_tokens=1)
    high = make_request(priority=-1, max_tokens=1)
    sched.add(low)
    sched.add(high)
    out = sched.schedule()
    assert out.requests == [high]
    sched.update(out, [5])
    drain(sched)
    assert_no_leaks(sched.blocks)


def test_preemption_by_recompute_when_blocks_run_out():
    # 6 blocks of 4 tokens; two requests of 8-token prompts that each grow to 16 tokens.
    sched = make_scheduler(num_blocks=6, block_size=4)
    a = make_request(num_prompt_tokens=8, max_tokens=8)
    b = make_request(num_prompt_tokens=8, max_tokens=8)
    sched.add(a)
    sched.add(b)
    preempted = []
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        preempted += out.preempted
        sched.update(out, [5 if r.num_computed_tokens + n == r.num_tokens else None
                           for r, n in zip(out.requests, out.num_new_tokens)])
    assert preempted and preempted[0] is b  # the later arrival goes first
    assert b.num_preemptions >= 1
    assert len(a.output_token_ids) == 8 and len(b.output_token_ids) == 8
    assert_no_leaks(sched.blocks)


def test_abort_at_any_moment_frees_blocks():
    for abort_after in range(0, 6):
        sched = make_scheduler(max_num_batched_tokens=4)
        reqs = [make_request(num_prompt_tokens=10, max_tokens=5) for _ in range(3)]
        for r in reqs:
            sched.add(r)
        for _ in range(abort_after):
            run_fake_step(sched)
        victim = reqs[1]
        if not victim.status.finished:
            sched.finish(victim.request_id, RequestStatus.FINISHED_ABORTED)
            assert victim.status == RequestStatus.FINISHED_ABORTED
        sched.finish(victim.request_id, RequestStatus.FINISHED_ABORTED)  # idempotent
        drain(sched)
        assert_no_leaks(sched.blocks)


def test_stop_token_ids_and_min_tokens():
    sched = make_scheduler()
    r = make_request(max_tokens=10, stop_token_ids=[5], min_tokens=2)
    sched.add(r)
    drain(sched)
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert len(r.output_token_ids) == 2 and r.stop_reason == 5
    assert_no_leaks(sched.blocks)


def test_status_order_puts_finished_last():
    assert all(s.finished for s in RequestStatus if s > RequestStatus.RUNNING)
    assert not any(s.finished for s in RequestStatus if s <= RequestStatus.RUNNING)


def admission_order(sched, requests):
    for r in requests:
        sched.add(r)
    order = []
    while sched.has_unfinished():
        out = sched.schedule()
        order += [r.request_id for r, n in zip(out.requests, out.num_new_tokens) if n > 1 and r.request_id not in order]
        sched.update(out, [7] * len(out.requests))
    assert_no_leaks(sched.blocks)
    return order


def test_shortest_prompt_first_with_a_maximum_wait():
    now = 1000.0  # the schedulers' clock stands still: how long each request has waited is exact

    def clock() -> float:
        return now

    def requests():  # arrival order: long, long, short, then a short one of lower priority
        return [make_request(num_prompt_tokens=30, request_id="long1", arrival_time=now - 3),
                make_request(num_prompt_tokens=20, request_id="long2", arrival_time=now - 2),
                make_request(num_prompt_tokens=5, request_id="short", arrival_time=now - 1),
                make_request(num_prompt_tokens=2, request_id="low", priority=1, arrival_time=now)]
    fcfs = admission_order(make_scheduler(max_num_seqs=1, enable_prefix_caching=False, clock=clock), requests())
    assert fcfs == ["long1", "long2", "short", "low"]
    spf = admission_order(make_scheduler(max_num_seqs=1, enable_prefix_caching=False, shortest_first_max_wait_s=60,
                                        clock=clock), requests())
    assert spf == ["short", "long2", "long1", "low"]  # priority still comes first
    # long1 has waited past the maximum: it goes ahead of the shorter ones
    aged = admission_order(make_scheduler(max_num_seqs=1, enable_prefix_caching=False, shortest_first_max_wait_s=2.5,
                                         clock=clock), requests())
    assert aged == ["long1", "short", "long2", "low"]
    # a second later long2 has waited past it too
    later = admission_order(make_scheduler(max_num_seqs=1, enable_prefix_caching=False, shortest_first_max_wait_s=2.5,
                                           clock=lambda: now + 1), requests())
    assert later == ["long1", "long2", "short", "low"]


def test_a_less_urgent_prompt_pauses_between_chunks_for_a_more_urgent_one():
    """A long priority-1 prompt is computing in chunks when a priority-0 prompt arrives: the next
    step is the urgent one's, whole; the long one keeps what it computed (no block freed, nothing
    recomputed) and goes on from there once the urgent one decodes."""
    sched = make_scheduler(num_blocks=128, block_size=4, max_num_batched_tokens=64)
    low = make_request(prompt=list(range(1, 201)), priority=1, max_tokens=2)
    sched.add(low)
    run_fake_step(sched)
    assert low.num_computed_tokens == 64
    table = list(sched.blocks.block_table(low.request_id))
    high = make_request(prompt=list(range(300, 330)), priority=0, max_tokens=2)  # no prefix in common
    sched.add(high)
    out = sched.schedule()
    assert out.requests == [high] and out.num_new_tokens == [30]  # the urgent prompt alone, whole
    sched.update(out, [5])
    assert low.num_computed_tokens == 64 and sched.blocks.block_table(low.request_id) == table
    out = sched.schedule()  # the urgent one decodes: the paused prompt goes on beside it
    assert out.requests == [high, low] and out.num_new_tokens == [1, 63]
    sched.update(out, [5, None])
    assert low.num_computed_tokens == 127 and sched.num_prefill_pauses == 1 and sched.num_preemptions == 0
    drain(sched)
    assert_no_leaks(sched.blocks)


def test_a_prompt_does_not_pause_for_one_that_could_not_be_admitted():
    """Pausing for a waiting prompt the pool has no room for, or no seat, would hold what it waits for."""
    sched = make_scheduler(num_blocks=14, block_size=4, max_num_batched_tokens=32)
    low = make_request(48, priority=1, max_tokens=2)
    sched.add(low)
    run_fake_step(sched)  # 8 of 14 blocks low's
    sched.add(make_request(100, priority=0, max_tokens=2))  # its first chunk needs 8
    out = sched.schedule()
    assert low in out.requests and sched.num_prefill_pauses == 0
    seated = make_scheduler(max_num_batched_tokens=16, max_num_seqs=1)
    low = make_request(48, priority=1, max_tokens=2)
    seated.add(low)
    run_fake_step(seated)
    seated.add(make_request(8, priority=0, max_tokens=2))
    assert low in seated.schedule().requests and seated.num_prefill_pauses == 0
