"""The NIXL agent's remote agents are bounded: unused ones are evicted least recently used first,
and with every one in use a new decode worker is refused (the prefill worker then falls back)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer.base import TransferError
from pdserve.kv_transfer.nixl import RemoteAgents, nixl_available


class FakeAgent:
    """NIXL's remote-agent calls, recorded: metadata b"x" belongs to the agent named "x"."""

    def __init__(self) -> None:
        self.known: set[str] = set()
        self.removed: list[str] = []

    def add_remote_agent(self, metadata: bytes) -> bytes:
        name = metadata.decode()
        assert name not in self.known, f"{name} added twice"
        self.known.add(name)
        return metadata

    def remove_remote_agent(self, name: str) -> None:
        self.known.remove(name)
        self.removed.append(name)


def test_unused_remotes_are_evicted_least_recently_used_first():
    agent = FakeAgent()
    remotes = RemoteAgents(agent, capacity=2)
    assert remotes.acquire(b"a") == "a" and remotes.acquire(b"b") == "b"
    assert remotes.acquire(b"a") == "a"  # known: no second add, one more user
    remotes.release(b"b")
    remotes.release(b"a")
    remotes.release(b"a")  # both unused now; "a" used last
    assert remotes.acquire(b"c") == "c"
    assert agent.removed == ["b"] and agent.known == {"a", "c"} and len(remotes) == 2


def test_a_new_remote_is_refused_while_all_are_in_use():
    agent = FakeAgent()
    remotes = RemoteAgents(agent, capacity=2)
    remotes.acquire(b"a")
    remotes.acquire(b"b")
    with pytest.raises(TransferError, match="all with transfers in use"):
        remotes.acquire(b"c")
    assert agent.known == {"a", "b"} and not agent.removed
    remotes.release(b"a")
    assert remotes.acquire(b"c") == "c" and agent.removed == ["a"]
    with pytest.raises(TransferError):
        remotes.acquire(b"a")  # "b" and "c" are in use


def test_an_evicted_remote_can_be_added_again_and_clear_removes_all():
    agent = FakeAgent()
    remotes = RemoteAgents(agent, capacity=1)
    remotes.acquire(b"a")
    remotes.release(b"a")
    remotes.acquire(b"b")
    remotes.release(b"b")
    assert remotes.acquire(b"a") == "a"
    assert agent.removed == ["a", "b"]
    remotes.release(b"x")  # never acquired: nothing happens
    remotes.clear()
    assert not agent.known and len(remotes) == 0


@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
def test_the_bound_holds_with_real_nixl_agents():
    from pdserve.kv_transfer.nixl import _Agent

    local, *peers = (_Agent(torch.zeros(1, 4, 2, 1, 4)) for _ in range(3))
    try:
        remotes = RemoteAgents(local.agent, capacity=1)
        first, second = (p.agent.get_agent_metadata() for p in peers)
        assert remotes.acquire(first) == peers[0].name
        with pytest.raises(TransferError):
            remotes.acquire(second)
        remotes.release(first)
        assert remotes.acquire(second) == peers[1].name  # the first was removed from NIXL to make room
        remotes.release(second)
        assert remotes.acquire(first) == peers[0].name  # and NIXL takes it back
        remotes.release(first)
        remotes.clear()
    finally:
        for agent in (*peers, local):
            agent.close()
