"""A backend this host cannot use is a skipped test case with its reason, never a missing one."""

from __future__ import annotations

import dataclasses

from tests import backends


def _skip_reason(case) -> str | None:
    for mark in case.marks:
        if mark.name == "skipif" and mark.args[0]:
            return mark.kwargs["reason"]
    return None


def test_an_unusable_backend_stays_as_a_skipped_case(monkeypatch):
    monkeypatch.setitem(backends.REGISTRY, "nixl",
                        dataclasses.replace(backends.REGISTRY["nixl"], available=lambda: False))
    got = {case.values[0]: _skip_reason(case) for case in backends.cases(backends.TRANSFER + ["memory"])}
    assert got == {"tcp": None, "shm": got["shm"], "nixl": "NIXL is not installed: the nixl package does not import",
                   "memory": None}
    assert "nixl" not in backends.usable(backends.TRANSFER)


def test_a_usable_backend_runs(monkeypatch):
    monkeypatch.setitem(backends.REGISTRY, "nixl",
                        dataclasses.replace(backends.REGISTRY["nixl"], available=lambda: True))
    (case,) = backends.cases(["nixl"])
    assert _skip_reason(case) is None and backends.usable(["nixl"]) == ["nixl"]
