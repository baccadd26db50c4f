"""A router that restarts on its address while clients keep sending: until the workers' next
heartbeats register them again (at most a heartbeat interval, since each worker re-registers at
once when its heartbeat is refused), the new router holds the requests it gets instead of
answering 503 for want of workers; every one is answered. Past its first moments, a router with
no worker still refuses at once."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx

from tests.router_server import MODEL, RouterServer
from tests.worker.cluster import Cluster, prompt


def test_a_restarted_router_holds_requests_until_the_workers_are_back(tiny_llama):
    with Cluster(tiny_llama, "tcp") as pair:
        first = RouterServer(tiny_llama, lease_s=3.0)
        restarted = None
        try:
            first.join(pair.p)
            first.join(pair.d)
            port = urlsplit(first.url).port
            first.server.stop()  # the router dies; its workers go on heartbeating to its address
            restarted = RouterServer(tiny_llama, port=port, lease_s=3.0)
            assert restarted.router.registry.workers() == []  # it knows nobody yet

            def ask(n: int) -> int:
                return httpx.post(restarted.url + "/v1/completions", timeout=60, json={
                    "model": MODEL, "prompt": prompt(10, seed=n), "max_tokens": 4}).status_code

            with ThreadPoolExecutor(4) as pool:
                statuses = list(pool.map(ask, range(8)))
            assert statuses == [200] * 8
            assert {w.role for w in restarted.router.registry.workers()} == {"prefill", "decode"}
        finally:
            for member in first.members:
                member.stop()
            if restarted is not None:
                restarted.stop()
        assert pair.p.is_idle() and pair.d.is_idle()


def test_a_router_without_workers_past_its_first_moments_refuses_at_once(tiny_llama):
    with RouterServer(tiny_llama, lease_s=3.0) as rs:
        time.sleep(max(0.0, rs.router.started + rs.router.fill_s - time.monotonic()))
        r = httpx.post(rs.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["message"] == "no worker is available"
