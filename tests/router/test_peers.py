"""Which router of several leads, on a clock the test moves: the live one whose address sorts
first; a peer silent for `DEAD_AFTER_S` is dead; a router alone leads at once, one with peers only
after it asked them all."""

from __future__ import annotations

import asyncio

import httpx

from pdserve import wire
from pdserve.router.peer_state import PeerState, RolloutView
from pdserve.router.peers import DEAD_AFTER_S, Peers

A, B, C = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_first_live_address_leads():
    clock = Clock()
    b = Peers(B, [A, B + "/", C], clock)
    assert b.peers == [A, C] and not b.leading  # it has not asked them yet
    b.asked_all = True
    assert b.leading  # nobody answered: B is the first live one
    b.heard(A)
    b.heard(C)
    assert b.leader == A and not b.leading
    clock.now += DEAD_AFTER_S - 0.1
    assert b.leader == A
    clock.now += 0.2  # A silent too long: dead
    assert b.leader == B and b.leading and b.view()["peers"] == {A: False, C: False}
    assert Peers(A, []).leading  # alone


def test_probing_hears_the_peers_that_answer():
    async def scenario():
        def handler(request: httpx.Request) -> httpx.Response:
            assert request.url.path == "/internal/peer" and request.headers["Authorization"] == "Bearer t"
            state = wire.encode(PeerState(rollout=RolloutView(stable="v1")))
            return httpx.Response(200 if request.url.port == 1 else 503, content=state)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            c = Peers(C, [A, B])
            await c.probe(http, {"Authorization": "Bearer t"})
            return c
    c = asyncio.run(scenario())
    assert c.asked_all and c.alive() == [A] and c.leader == A and not c.leading
    assert c.leader_state.rollout.stable == "v1" and [s.rollout.stable for s in c.live_states().values()] == ["v1"]
