"""`wait_for`, which every test that polls uses: it returns as soon as the condition holds, and a
condition that never comes fails with what was awaited and the state that explains it."""

import itertools

import pytest

from tests.wait import wait_for


def test_returns_once_the_condition_holds():
    calls = itertools.count(1)
    wait_for(lambda: next(calls) == 3, 10, "the third call", interval=0.001)
    assert next(calls) == 4


def test_a_condition_that_never_comes_names_what_was_awaited():
    with pytest.raises(AssertionError, match=r"timed out after 0.05s waiting for the moon: it is still day"):
        wait_for(lambda: False, 0.05, "the moon", state=lambda: "it is still day")
