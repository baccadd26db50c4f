"""The capacity search on tests whose answer is known: it brackets the answer within the
tolerance from any guess, costs two tests from an exact informed guess, and gives 0 for a test
that no rate passes."""

from __future__ import annotations

import pytest

from pdserve.sim.rate_search import highest_passing_rate


class Threshold:
    """Passes below `capacity`; counts the tests."""

    def __init__(self, capacity: float) -> None:
        self.capacity, self.tests = capacity, []

    def __call__(self, rate: float) -> bool:
        self.tests.append(rate)
        return rate <= self.capacity


@pytest.mark.parametrize("guess_over_answer", [0.01, 0.3, 0.97, 1.0, 1.04, 3.0, 250.0])
@pytest.mark.parametrize("informed", [False, True])
def test_the_answer_is_within_the_tolerance_below_the_capacity(guess_over_answer, informed):
    test = Threshold(2.5)
    rate = highest_passing_rate(test, 2.5 * guess_over_answer, 0.05, informed)
    assert rate <= 2.5 < rate * 1.05
    assert any(r > 2.5 for r in test.tests) and any(r <= 2.5 for r in test.tests)  # bracketed by real tests


def test_an_exact_informed_guess_costs_two_tests_and_a_poor_one_a_few_more():
    exact = Threshold(2.5)
    highest_passing_rate(exact, 2.5, 0.05, informed=True)
    assert len(exact.tests) == 2
    off = Threshold(2.5)
    highest_passing_rate(off, 2.0, 0.05, informed=True)
    cold = Threshold(2.5)
    highest_passing_rate(cold, 8.0, 0.05, informed=False)
    assert len(off.tests) <= 6 and len(off.tests) < len(cold.tests)


def test_a_test_no_rate_passes_gives_zero_and_one_every_rate_passes_stops():
    never = Threshold(0.0)
    assert highest_passing_rate(never, 1.0, 0.05) == 0.0
    assert min(never.tests) <= 1e-6
    always = Threshold(float("inf"))
    assert highest_passing_rate(always, 1.0, 0.05, ceiling=64) >= 64


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        highest_passing_rate(lambda r: True, 0.0)
    with pytest.raises(ValueError):
        highest_passing_rate(lambda r: True, 1.0, tolerance=0)
