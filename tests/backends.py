"""The KV transfer backends tests run over. One this host cannot use (NIXL not installed, no
writable /dev/shm) stays a test case, marked skipped with the reason, so that `pytest -rs` says
what did not run instead of the case silently vanishing from the report."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer.registry import BACKENDS as REGISTRY

TRANSFER = ["tcp", "shm", "nixl"]  # the ones that carry KV between processes

_WHY = {"nixl": "NIXL is not installed: the nixl package does not import",
        "shm": "no writable /dev/shm on this host"}


def usable(names: list[str]) -> list[str]:
    """The named backends this host can use: for a test that loops over them inside one case."""
    return [n for n in names if REGISTRY[n].available()]


def cases(names: list[str]) -> list:
    """Every named backend as a `parametrize` case; the unusable ones skipped, with the reason."""
    return [pytest.param(n, marks=pytest.mark.skipif(not REGISTRY[n].available(),
                                                     reason=_WHY.get(n, f"the {n} backend is unavailable here")))
            for n in names]
