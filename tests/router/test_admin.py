"""The router's admin API: absent without a key, closed to anyone without it, and with it a view of
every worker and a drain that reaches the worker."""

from __future__ import annotations

import httpx
import pytest

from tests.router_server import RouterServer
from tests.wait import wait_for
from tests.worker.cluster import WorkerServer

KEY = "admin-" + "k" * 32


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    with (WorkerServer(tiny_llama, "prefill", ["tcp"]) as p, WorkerServer(tiny_llama, "decode", ["tcp"]) as d,
          RouterServer(tiny_llama, admin_key=KEY, lease_s=1.5) as rs):
        rs.join(p)
        rs.join(d)
        yield rs, p, d


def admin(rs, method: str, path: str, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.request(method, rs.url + path, headers=headers, timeout=10)


def test_no_admin_api_without_a_key(tiny_llama):
    with RouterServer(tiny_llama) as rs:
        assert httpx.get(rs.url + "/admin/workers").status_code == 404
        assert httpx.post(rs.url + "/admin/workers/w0/drain").status_code == 404


@pytest.mark.parametrize("key", [None, "wrong", KEY + "x"])
def test_the_admin_api_wants_its_key(cluster, key):
    rs, _, _ = cluster
    for method, path in (("GET", "/admin/workers"), ("POST", "/admin/workers/w0/drain")):
        r = admin(rs, method, path, key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_workers_and_health_show_the_cluster(cluster):
    rs, p, d = cluster
    workers = admin(rs, "GET", "/admin/workers").json()["workers"]
    by_url = {w["url"]: w for w in workers}
    assert set(by_url) == {p.url, d.url}
    assert by_url[p.url]["role"] == "prefill" and by_url[d.url]["role"] == "decode"
    for w in workers:
        assert w["state"] == "serving" and w["host"] == "127.0.0.1" and w["kv_usage"] == 0  # nothing running
        assert w["running"] == w["queued"] == 0 and w["heartbeat_age_s"] >= 0
    health = httpx.get(rs.url + "/health").json()
    assert {k: v for k, v in health.items() if k != "leading"} == {"status": "ok", "workers": 2,
                                                                  "roles": {"prefill": 1, "decode": 1, "both": 0}}
    wait_for(lambda: httpx.get(rs.url + "/health").json()["leading"], 10, "the lone router to lead")


def test_a_drain_reaches_the_worker_and_the_router_sees_it(cluster):
    rs, p, _ = cluster
    assert admin(rs, "POST", "/admin/workers/nobody/drain").status_code == 404
    wid = next(w["id"] for w in admin(rs, "GET", "/admin/workers").json()["workers"] if w["url"] == p.url)
    r = admin(rs, "POST", f"/admin/workers/{wid}/drain")
    assert r.status_code == 200 and r.json() == {"id": wid, "state": "draining"}
    assert p.worker.draining  # in this process a drain stays in place (a worker process then exits)
    wait_for(lambda: {w["id"]: w["state"] for w in admin(rs, "GET", "/admin/workers").json()["workers"]}[wid]
             == "draining", 10, "the router to see the drain")
    assert httpx.get(p.url + "/health").status_code == 503


def test_a_worker_changes_role_without_restarting(tiny_llama):
    """decode -> prefill -> decode by the admin API: the same process (same URL), drained in place
    each time, registered again in its new role; requests keep being answered, disaggregated
    through it while it is a prefill worker."""
    with (WorkerServer(tiny_llama, "decode", ["tcp"]) as flips, WorkerServer(tiny_llama, "decode", ["tcp"]) as d,
          RouterServer(tiny_llama, admin_key=KEY, lease_s=1.5) as rs):
        rs.join(flips)
        rs.join(d)

        def roles() -> dict[str, str]:
            return {w["url"]: w["role"] for w in admin(rs, "GET", "/admin/workers").json()["workers"]}

        def complete(i: int) -> None:  # a prompt long enough, and new, to be worth a prefill worker
            body = {"model": "tiny", "prompt": [7 + i] + [(5 * j + i) % 400 + 1 for j in range(300)],
                    "max_tokens": 4, "temperature": 0}
            assert httpx.post(rs.url + "/v1/completions", json=body, timeout=60).status_code == 200

        wid = next(w["id"] for w in admin(rs, "GET", "/admin/workers").json()["workers"] if w["url"] == flips.url)
        assert admin(rs, "POST", f"/admin/workers/{wid}/role").status_code == 400  # no body
        r = httpx.post(rs.url + f"/admin/workers/{wid}/role", json={"role": "router"},
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "role"
        r = httpx.post(rs.url + f"/admin/workers/{wid}/role", json={"role": "prefill"},
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["state"] == "changing"
        wait_for(lambda: roles() == {flips.url: "prefill", d.url: "decode"}, 30, "the new role", state=roles)
        assert flips.worker.role == "prefill" and not flips.worker.draining
        landed = d.worker.stats().kv_landed
        for i in range(3):
            complete(i)
        assert d.worker.stats().kv_landed > landed  # prompts went through the flipped worker's prefill
        assert httpx.get(rs.url + "/health").json()["roles"] == {"prefill": 1, "decode": 1, "both": 0}

        wid = next(w["id"] for w in admin(rs, "GET", "/admin/workers").json()["workers"] if w["url"] == flips.url)
        r = httpx.post(rs.url + f"/admin/workers/{wid}/role", json={"role": "decode"},
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200
        wait_for(lambda: roles() == {flips.url: "decode", d.url: "decode"}, 30, "decode again", state=roles)
        complete(3)
        wait_for(lambda: flips.is_idle() and d.is_idle(), 10, "both idle")
