"""Routers found behind one name (`dns+http://NAME:PORT`, a Kubernetes headless Service): each
address the name resolves to is a router, looked up again as pods come and go, by a worker
(`--router`: one membership per router, joined and let go) and by a router (`--peers`)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.peers import Peers
from pdserve.router_addresses import check, expand, is_dynamic
from pdserve.worker.registration import Memberships
from tests.wait import wait_for


class Names:
    """A resolver the test sets: name -> addresses (a name missing does not resolve)."""

    def __init__(self, **names: list[str]) -> None:
        self.names = names

    def __call__(self, host: str, port: int) -> list[str]:
        if host not in self.names:
            raise OSError(f"{host}: name not known")
        return self.names[host]


def test_a_dns_address_stands_for_every_address_of_its_name():
    names = Names(routers=["10.0.0.7", "10.0.0.5", "fd00::3"])
    assert expand("dns+http://routers:8000, http://other:9000/", names) == [
        "http://10.0.0.7:8000", "http://10.0.0.5:8000", "http://[fd00::3]:8000", "http://other:9000"]
    assert expand("dns+http://nobody:8000", names) == []  # not resolvable yet: none for now
    assert is_dynamic("http://a:1,dns+http://b:2") and not is_dynamic("http://a:1,http://b:2")


def test_real_resolution_of_localhost():
    assert "http://127.0.0.1:8000" in expand("dns+http://localhost:8000")


@pytest.mark.parametrize("spec, why", [("", "no router"), ("ftp://a:1", "not an http"), ("dns+http://a", "port"),
                                       ("routers:8000", "not an http")])
def test_a_value_that_names_no_router_is_refused(spec, why):
    with pytest.raises(ValueError, match=why):
        check(spec)


class Member:
    def __init__(self, url: str) -> None:
        self.router_url, self.started, self.stopped, self.status = url, False, False, "registered"

    def start(self):
        self.started = True
        return self

    def stop(self, wait: bool = True) -> None:
        self.stopped = True

    def beat_now(self) -> None:
        pass


def test_a_worker_joins_routers_that_appear_and_lets_go_of_those_gone():
    names = Names(routers=["10.0.0.1", "10.0.0.2"])
    made: list[Member] = []
    members = Memberships("dns+http://routers:8000", lambda url: made.append(Member(url)) or made[-1], names)
    members._refresh.every_s = 0.05
    members.start()
    try:
        assert [m.router_url for m in members.members] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
        names.names["routers"] = ["10.0.0.2", "10.0.0.3"]  # a pod replaced
        wait_for(lambda: [m.router_url for m in members.members] == ["http://10.0.0.2:8000", "http://10.0.0.3:8000"],
                 5, "the new router joined and the old let go", state=lambda: [m.router_url for m in members.members])
        assert made[0].stopped and not made[1].stopped and made[2].started
        del names.names["routers"]  # the name stops resolving for a moment: nothing is let go for it
        members._refresh.apply = lambda urls: pytest.fail(f"applied {urls}")
        asyncio.run(asyncio.sleep(0.2))
        assert [m.router_url for m in members.members] == ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    finally:
        members.stop()
    assert all(m.stopped for m in made)


def test_a_router_finds_its_peers_behind_a_name_and_leaves_itself_out():
    names = Names(routers=["10.0.0.1", "10.0.0.2", "10.0.0.3"])

    async def scenario():
        peers = Peers("http://10.0.0.1:8000", [], spec="dns+http://routers:8000", resolve=names, clock=lambda: 0.0)
        assert not peers.asked_all  # a name may hide peers: it does not lead before it looked
        await peers.look_up()
        found = list(peers.peers)
        del names.names["routers"]
        peers.next_lookup = 0.0
        await peers.look_up()  # does not resolve this time: the peers stay
        return found, peers.peers
    found, after = asyncio.run(scenario())
    assert found == after == ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]
