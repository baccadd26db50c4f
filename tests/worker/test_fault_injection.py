"""The worker's fault-injection route, a testing aid: refused unless the worker runs with it, and
never without the token; when on, it closes every KV connection of the worker, and the next
request connects again and is served in full."""

from __future__ import annotations

import httpx

from tests.worker.cluster import Cluster, WorkerServer, prompt

TOKEN = "t" * 32
ROUTE = "/v1/faults/cut-kv-links"


def test_the_route_is_refused_without_the_flag_and_without_the_token(tiny_llama):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with WorkerServer(tiny_llama, "decode", ["tcp"], TOKEN) as off:
        r = httpx.post(off.url + ROUTE, headers=auth)
        assert r.status_code == 403 and "--fault-injection" in r.json()["error"]["message"]
        assert httpx.post(off.url + ROUTE).status_code == 401
    with WorkerServer(tiny_llama, "decode", ["tcp"], TOKEN, fault_injection=True) as on:
        assert httpx.post(on.url + ROUTE).status_code == 401
        assert httpx.post(on.url + ROUTE, headers={"Authorization": "Bearer " + "x" * 32}).status_code == 401
        r = httpx.post(on.url + ROUTE, headers=auth)
        assert r.status_code == 200 and r.json() == {"sender_links": 0, "receiver_connections": 0}


def test_cut_links_on_either_side_are_connected_again(tiny_llama):
    with Cluster(tiny_llama, "tcp", token=TOKEN, fault_injection=True) as c:
        expected, _ = c.generate(prompt(40, seed=1))
        assert c.http.post(c.d.url + ROUTE).json() == {"sender_links": 0, "receiver_connections": 1}
        assert c.generate(prompt(40, seed=1))[0] == expected  # the prefill worker connected again
        assert c.http.post(c.p.url + ROUTE).json()["sender_links"] == 1
        assert c.generate(prompt(40, seed=1))[0] == expected
        c.wait_idle()
        assert c.d.worker.stats().kv_landed >= 1
