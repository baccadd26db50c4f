"""The worker's fault-injection route, a testing aid: refused unless the worker runs with it, and
never without the token; when on, it closes every KV connection of the worker, and the next
request connects again and is served in full."""

from __future__ import annotations

import httpx

from tests.wait import wait_for
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


def test_a_lease_queued_when_its_link_is_cut_is_sent_on_a_new_link(tiny_llama):
    """A prefill worker took a lease (its link to the decode worker chosen) but had not started it
    when the link was cut: the KV goes over a new link, instead of into a closed one while the
    decode worker waits for its lease to time out."""
    import json
    import threading

    with Cluster(tiny_llama, "tcp", token=TOKEN, fault_injection=True) as c:
        expected, _ = c.generate(prompt(40, seed=2))  # a link is open
        hold = threading.Event()
        c.p.worker.loop.call(lambda: hold.wait(60))  # the prefill engine is busy: the next lease waits
        out: list = []

        def generate() -> None:  # the stream's empty lines are keep-alives while the request waits
            with c.http.stream("POST", c.d.url + "/v1/generate", json=c.body(prompt(40, seed=2))) as r:
                lines = [json.loads(line) for line in r.iter_lines() if line.strip()]
            out.append([t for line in lines for t in line["outputs"][0]["token_ids"]])

        t = threading.Thread(target=generate)
        t.start()
        # the decode worker leased blocks and asked the prefill worker, which took the lease (chose
        # its link) and queued it behind the held engine
        wait_for(lambda: c.d.worker.receiver.num_open_leases, 10, "a lease opened on the decode worker")
        wait_for(lambda: c.p.worker.loop._calls.qsize() >= 1, 10, "the lease queued on the prefill engine")
        assert c.p.worker.cut_kv_links()["sender_links"] == 1
        hold.set()
        t.join(60)
        assert not t.is_alive(), "the request had not ended after 60s"
        assert out == [expected]
        c.wait_idle()
        stats = c.d.worker.stats()
        assert stats.kv_landed == 2 and stats.kv_recomputed == 0, stats
