"""The draft budget: drafts verified while their expected kept tokens pay for the rows they add,
priced by measured decode steps; the rate a request's drafts are kept estimated from its history
and the engine's."""

from __future__ import annotations

import pytest

from pdserve.engine.spec.budget import FIRST_RATE, Acceptance, DraftBudget, StepCosts


def budget_with_costs(seconds_at: dict[int, float]) -> DraftBudget:
    budget = DraftBudget()
    for rows, seconds in seconds_at.items():
        budget.costs.observe(rows, seconds)
    return budget


def sure(rate: float, tries: float = 1000.0) -> Acceptance:
    """A request whose history says `rate`, with so much of it that no prior matters."""
    return Acceptance(kept=rate * tries, tried=tries)


def test_before_any_step_is_measured_every_draft_is_verified():
    budget = DraftBudget()
    assert budget.cut([([1, 2, 3], Acceptance(), False), ([4], sure(0.0), False)], rows=2) == [3, 1]


def test_a_count_not_measured_is_read_off_the_line_through_its_neighbours():
    costs = StepCosts()
    assert costs.at(4) is None
    for rows, seconds in {2: 0.010, 6: 0.014, 8: 0.020}.items():
        costs.observe(rows, seconds)
    assert costs.at(6) == pytest.approx(0.014)
    assert costs.at(4) == pytest.approx(0.012)  # between 2 and 6
    assert costs.at(1) == pytest.approx(0.010)  # before the first: its value
    assert costs.at(10) == pytest.approx(0.026)  # past the last: the last two's slope
    costs.observe(2, 0.020)  # a moving average: the new step counts a fifth
    assert costs.at(2) == pytest.approx(0.012)


def test_one_stream_on_cheap_rows_verifies_long_drafts_a_full_batch_none():
    # a row costs 2% of a step of one, 4% of a step of sixteen: a token kept half the time pays
    # for one stream (it gives 50% more tokens), not for sixteen (3%)
    one = budget_with_costs({1: 0.050, 5: 0.054})
    assert one.cut([([1, 2, 3, 4], sure(0.5), False)], rows=1) == [4]
    assert one.cut([([1, 2, 3, 4], sure(0.05), False)], rows=1) == [1]  # 0.05 pays for 2%; 0.05 ** 2 does not
    full = budget_with_costs({16: 0.100, 20: 0.116})
    drafts = [([1, 2, 3, 4], sure(0.5), False)] * 16
    assert full.cut(drafts, rows=16) == [0] * 16
    # nearly sure drafts still pay in a full batch, the likeliest tokens first
    assert full.cut([([1, 2, 3, 4], sure(0.99), False), ([5, 6], sure(0.5), False)], rows=16) == [4, 0]


def test_a_row_count_whose_step_costs_a_jump_is_avoided():
    # past 16 rows a second block of tile rows: 17 costs as much as 24
    jump = budget_with_costs({16: 0.100, 17: 0.140, 24: 0.141})
    even = [([1, 2, 3, 4, 5, 6, 7, 8], sure(0.5), False)] * 2
    assert jump.cut(even, rows=15) == [1, 0]  # up to 16 rows, not one more
    assert jump.cut(even, rows=16) == [0, 0]
    likely = [([1, 2, 3, 4, 5, 6, 7, 8], sure(0.95), False)] * 2
    assert jump.cut(likely, rows=16) == [8, 8]  # enough of them pay for the jump


def test_a_probe_is_priced_at_the_engines_rate():
    """A probe (a request with no history, or back after misses) is priced at the engine's recent
    rate, not its own: verified where drafts are being kept and that pays for its rows, never
    where one more row past a jump in step cost would cost more than the engine's drafts give."""
    costs = {8: 0.081, 9: 0.100, 16: 0.104}
    kept, missed = budget_with_costs(costs), budget_with_costs(costs)
    kept.engine, missed.engine = sure(0.95), sure(0.1)
    probe = [([1] * 8, sure(0.0), True)]
    assert kept.cut(probe, rows=8) == [8]  # found out: its drafts may be as good as the others'
    assert missed.cut(probe, rows=8) == [0]
    assert kept.cut([([1] * 8, sure(0.0), False)], rows=8) == [0]  # not a probe: its own rate
    assert kept.cut([([1], sure(0.0), True)], rows=8) == [0]  # 9 rows in 0.100 s: less than 8 in 0.081


def test_a_requests_rate_starts_at_the_engines_and_follows_its_own_drafts():
    budget = DraftBudget()
    fresh = Acceptance()
    assert budget.rate(fresh) == pytest.approx(FIRST_RATE)
    copying = Acceptance()
    for _ in range(20):
        budget.verified(copying, kept=4, drafted=4)
    assert budget.rate(copying) > 0.9
    assert budget.rate(Acceptance()) > FIRST_RATE  # the engine learned that drafts are kept
    chatting = Acceptance()
    for _ in range(20):
        budget.verified(chatting, kept=0, drafted=3)
    assert budget.rate(chatting) < 0.35


def test_a_costly_proposer_drafts_as_far_ahead_as_pays_and_sits_out_where_nothing_does():
    """A step of 1-9 rows costs 10 ms plus 0.1 ms a row; the engine keeps 90% of draft tokens. A
    draft model at 0.5 ms a token drafts far ahead; one costing a whole step (a self-draft of the
    same size) could not pay even if every draft held, and sits out for MAX_PROBE_EVERY steps at a
    time; one that would pay at a better rate drafts one token after PROBE_EVERY steps, then after
    twice as many, so that its estimates follow at a bounded cost."""
    from pdserve.engine.spec.budget import MAX_PROBE_EVERY, PROBE_EVERY

    budget = budget_with_costs({rows: 0.010 + 0.0001 * rows for rows in range(1, 10)})
    budget.engine = sure(0.9)
    assert budget.lead(rows=1, drafting=1, draft_seconds=None, most=8) == 8  # not measured: drafting measures it
    assert budget.lead(rows=1, drafting=1, draft_seconds=0.0005, most=8) == 8
    cheap = budget.lead(rows=1, drafting=1, draft_seconds=0.004, most=8)
    assert 1 <= cheap < 8  # each token ahead pays less than the one before
    budget.engine = sure(0.3)  # drafts at 3 ms a token that would pay if more of them held
    answers = [budget.lead(rows=1, drafting=1, draft_seconds=0.003, most=8) for _ in range(3 * PROBE_EVERY)]
    assert answers == [0] * (PROBE_EVERY - 1) + [1] + [0] * (2 * PROBE_EVERY - 1) + [1]  # then twice as long
    budget.engine = sure(0.9)
    assert budget.lead(rows=1, drafting=1, draft_seconds=0.0005, most=8) == 8  # it pays again: probes reset
    assert budget.probe_every == PROBE_EVERY
    assert budget.lead(rows=1, drafting=1, draft_seconds=0.012, most=8) == 0  # as costly as a step: hopeless
    assert budget.probe_every == MAX_PROBE_EVERY
    budget.engine = sure(0.05)  # drafts that almost never hold: even a cheap draft sits out
    assert budget.lead(rows=1, drafting=1, draft_seconds=0.0005, most=8) == 0
