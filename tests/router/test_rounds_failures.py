"""The router's background rounds when something fails: a round that raises does not end the
reaper (the next round, and the other rounds, run all the same), and hot-spot relief that cannot
reach the hot worker leaves the request where it is, for the failure path to take over. And a
worker the router forgot (a heartbeat answered 404) registers again."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdserve import wire
from pdserve.router.rounds import Rounds
from pdserve.router.streams import LiveStream
from pdserve.worker.registration import RouterMembership
from tests.router_server import RouterServer, make_router
from tests.wait import wait_for


def test_a_round_that_raises_does_not_end_the_reaper(tiny_llama, monkeypatch):
    router = make_router(tiny_llama, lease_s=0.04)  # the reaper turns every lease_s / 4
    calls = {"relief": 0, "rebalance": 0}

    async def broken_relief() -> None:
        calls["relief"] += 1
        raise RuntimeError("relief broke")

    async def rebalance() -> None:
        calls["rebalance"] += 1

    periodic = Rounds(router)
    monkeypatch.setattr(periodic, "relieve_hot_spots", broken_relief)
    monkeypatch.setattr(periodic, "rebalance", rebalance)

    async def scenario() -> None:
        reaper = asyncio.create_task(periodic.run())
        try:
            while calls["rebalance"] < 3:  # each round after the failing one, three turns in a row
                assert not reaper.done(), reaper
                await asyncio.sleep(0.01)
        finally:
            reaper.cancel()
    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert calls["relief"] >= 3


def hot_and_cool(router) -> tuple:
    registry = router.registry
    hot = registry.register("http://hot.invalid:1", "decode", registry.model_hash)
    cool = registry.register("http://cool.invalid:1", "decode", registry.model_hash)
    registry.heartbeat(hot.worker_id, wire.WorkerStats(role="decode", running=1, kv_blocks_total=100,
                                                       kv_blocks_used=95))
    registry.heartbeat(cool.worker_id, wire.WorkerStats(role="decode", kv_blocks_total=100))
    live = LiveStream("s", n=1, context_tokens=300, remaining_tokens=200, worker_id=hot.worker_id,
                      worker_request_id="s-0")
    router.live[live.request_id] = live
    return hot, cool, live


@pytest.mark.parametrize("hot_worker", ["answers", "unreachable"])
def test_relief_moves_a_request_only_when_the_hot_worker_took_the_abort(tiny_llama, hot_worker):
    router = make_router(tiny_llama)
    hot, cool, live = hot_and_cool(router)
    aborts = []

    def handler(request: httpx.Request) -> httpx.Response:
        aborts.append((request.url.host, wire.decode(request.content, wire.AbortRequest).request_id))
        if hot_worker == "unreachable":
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, content=wire.encode(wire.Aborted(request_id="s-0")))

    periodic = Rounds(router)

    async def scenario() -> None:
        router.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        try:
            await periodic.relieve_hot_spots()
        finally:
            await router.http.aclose()
    asyncio.run(scenario())

    assert aborts == [("hot.invalid", "s-0")]  # relief asked the hot worker to stop it
    assert live.moving_to is (cool if hot_worker == "answers" else None)
    # either way both workers wait for their next heartbeat before relief looks at them again
    assert periodic.relieved_at == {hot.worker_id: 1, cool.worker_id: 1}


def test_a_worker_the_router_forgot_registers_again(tiny_llama):
    stats = lambda: wire.WorkerStats(role="decode", kv_blocks_total=8)  # noqa: E731
    with RouterServer(tiny_llama, lease_s=60.0) as rs:  # no lease lapses here: only the router forgets
        registry, url = rs.router.registry, "http://127.0.0.1:5"
        member = RouterMembership(rs.url, url, "decode", registry.model_hash, stats).start()
        try:
            wait_for(lambda: [e.heartbeats for e in registry.workers()] == [1], 30, "the first heartbeat")
            (first,) = registry.workers()
            r = httpx.post(rs.url + "/internal/deregister",
                           content=wire.encode(wire.Deregistration(worker_id=first.worker_id)))
            assert r.status_code == 200 and registry.workers() == []
            # the next heartbeat is answered 404, and the one after registers again (each sent now)
            wait_for(lambda: member.beat_now() or (registry.workers() and member.status == "registered"), 30,
                     "registered again", state=lambda: (registry.workers(), member.status))
            (again,) = registry.workers()
            assert again.worker_id != first.worker_id and (again.url, again.role) == (url, "decode")
            assert member.worker_id == again.worker_id
        finally:
            member.stop()
