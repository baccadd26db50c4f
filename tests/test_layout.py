"""Which workers `pdserve serve` starts: the flags' layout, or the one chosen for the host."""

import pytest

from pdserve.cli import build_parser
from pdserve.launcher import serve_layout
from pdserve.layout import MIN_CORES_PER_POOL, choose, from_flags


def test_a_host_too_small_for_two_pools_runs_one_colocated_worker():
    for cores in range(1, 2 * MIN_CORES_PER_POOL):
        chosen = choose(cores)
        assert chosen.roles == ["both"], cores
        assert f"{cores} cores" in chosen.reason and "--prefill 1 --decode 1" in chosen.reason


def test_a_host_with_cores_for_two_pools_disaggregates():
    chosen = choose(2 * MIN_CORES_PER_POOL)
    assert chosen.roles == ["prefill", "decode"] and f"each pool gets {MIN_CORES_PER_POOL}" in chosen.reason


def test_gpus_one_colocated_two_split():
    assert choose(64, "cuda", 1).roles == ["both"]
    assert choose(64, "cuda:0", 2).roles == ["prefill", "decode"]


@pytest.mark.parametrize("flags, roles", [
    ({}, None),
    ({"colocated": 2}, ["both", "both"]),
    ({"prefill": 2}, ["prefill", "prefill", "decode"]),  # a pool given alone: disaggregated, the other of one
    ({"decode": 3}, ["prefill", "decode", "decode", "decode"]),
    ({"prefill": 0, "decode": 0, "colocated": 1}, ["both"]),
    ({"prefill": 1, "decode": 1, "colocated": 1}, ["prefill", "decode", "both"]),
])
def test_flags_give_the_layout(flags, roles):
    given = from_flags(flags.get("prefill"), flags.get("decode"), flags.get("colocated"))
    assert (given and given.roles) == roles


@pytest.mark.parametrize("flags, message", [
    ({"prefill": 0, "decode": 0}, "at least one worker"),
    ({"colocated": 0}, "at least one worker"),
    ({"decode": -1}, "--decode must not be negative"),
])
def test_a_layout_without_workers_is_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        from_flags(flags.get("prefill"), flags.get("decode"), flags.get("colocated"))


def test_serve_without_layout_flags_chooses_for_this_host(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(2)))
    assert serve_layout(build_parser().parse_args(["serve"])).roles == ["both"]
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert serve_layout(build_parser().parse_args(["serve"])).roles == ["prefill", "decode"]
    assert serve_layout(build_parser().parse_args(["serve", "--colocated", "1"])).roles == ["both"]
