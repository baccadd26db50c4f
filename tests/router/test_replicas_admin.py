"""Admin actions with two routers serving one cluster (in this process, on 127.0.0.1; real workers
of two versions registered with both): a rollout or a shadow asked of the follower is the leader's,
every router routes by it within a round, the leader judges each step on the requests both routers
served, and when the leader dies the other goes on with the rollout where it was."""

from __future__ import annotations

import httpx
import openai
import pytest

from pdserve.router.peers import DEAD_AFTER_S, Peers
from pdserve.telemetry.shadow_report import render
from tests.router_server import MODEL, RouterServer
from tests.wait import wait_for
from tests.worker.cluster import WorkerServer, prompt

KEY = "admin-key-for-tests"


@pytest.fixture
def cluster(tiny_llama):
    """(leader, follower, v1 worker, v2 worker): two routers that know each other, both workers
    registered with both."""
    workers = [WorkerServer(tiny_llama, "both", ["tcp"], worker_args={"version": v}) for v in ("v1", "v2")]
    routers = [RouterServer(tiny_llama, admin_key=KEY, lease_s=2.0, stable_version="v1") for _ in range(2)]
    try:
        for r in routers:
            r.router.peers = Peers(r.url, [o.url for o in routers if o is not r])
        for w in workers:
            routers[0].members.append(w.worker.join(",".join(r.url for r in routers), w.url, ""))
        for r in routers:
            wait_for(lambda r=r: len([e for e in r.router.registry.workers() if e.heartbeats]) == 2, 20,
                     "both workers registered", state=lambda r=r: r.router.registry.workers())
        wait_for(lambda: sorted(r.router.leading for r in routers) == [False, True], 15, "one leader",
                 state=lambda: [r.router.peers.view() for r in routers])
        leader, follower = sorted(routers, key=lambda r: not r.router.leading)
        yield leader, follower, *workers
    finally:
        for r in routers:
            r.stop()
        for w in workers:
            w.stop()


def admin(rs: RouterServer, path: str, body: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    if body is None:
        return httpx.get(rs.url + path, headers=headers, timeout=10)
    return httpx.post(rs.url + path, json=body, headers=headers, timeout=10)


def complete(rs: RouterServer, n: int) -> None:
    client = openai.OpenAI(base_url=rs.url + "/v1", api_key="none", max_retries=0, timeout=60)
    for i in range(n):
        client.completions.create(model=MODEL, prompt=prompt(10 + i % 5, seed=i), max_tokens=3, temperature=0)


def test_a_rollout_asked_of_the_follower_is_the_leaders_and_judged_on_both_routers_requests(cluster):
    leader, follower, _, _ = cluster
    r = admin(follower, "/admin/rollout", {"canary": "v2", "steps": [0.5, 1.0], "step_s": 0.5, "min_requests": 6})
    assert r.status_code == 200 and r.json()["state"] == "running", r.text
    assert leader.router.rollout.state == "running"  # the leader's own, not the follower's
    rollout_id = leader.router.rollout.id
    wait_for(lambda: (follower.router.rollout.id, follower.router.rollout.share) == (rollout_id, 0.5), 5,
             "the follower routing by the leader's rollout", state=lambda: follower.router.rollout.status())
    for _ in range(200):  # only the follower serves: the leader judges on its outcomes all the same
        if leader.router.rollout.state != "running":
            break
        complete(follower, 1)
    wait_for(lambda: leader.router.rollout.state == "promoted", 10, "the canary promoted",
             state=lambda: leader.router.rollout.status())
    served = [line for line in httpx.get(leader.url + "/metrics").text.splitlines()
              if line.startswith("pdserve_requests_total{")]
    assert served == [], served  # the leader served none of them itself
    assert [e["event"] for e in leader.router.rollout.events] == ["started", "advanced", "promoted"]
    wait_for(lambda: follower.router.rollout.stable == "v2", 5, "the follower taking v2 as stable")
    assert admin(follower, "/admin/rollout").json()["events"] == admin(leader, "/admin/rollout").json()["events"]
    metrics = httpx.get(leader.url + "/metrics").text
    assert 'pdserve_rollouts_total{outcome="promoted"} 1.0' in metrics  # counted once, by the leader
    assert 'pdserve_rollouts_total{outcome="promoted"} 1.0' not in httpx.get(follower.url + "/metrics").text


def test_a_shadow_asked_of_the_follower_runs_on_both_and_stops_on_both(cluster):
    leader, follower, _, _ = cluster
    r = admin(follower, "/admin/shadow", {"version": "v2", "share": 1.0, "max_concurrency": 2})
    assert r.status_code == 200, r.text
    assert leader.router.shadow is not None and leader.router.shadow.version == "v2"
    wait_for(lambda: follower.router.shadow is not None, 5, "the follower copying too")
    complete(follower, 3)
    wait_for(lambda: follower.router.shadow.counts["mirrored"] == 3, 10, "the follower's copies",
             state=lambda: follower.router.shadow.counts)
    report = admin(follower, "/admin/shadow").json()  # the leader's, saying so
    assert (report["routers"], report["copies_of"]) == (2, "this router")
    assert "one of 2 routers" in render(report)
    assert admin(follower, "/admin/shadow/stop", {}).status_code == 200
    assert leader.router.shadow is None
    wait_for(lambda: follower.router.shadow is None, 5, "the follower stopping its copies")


def test_the_follower_goes_on_with_the_rollout_when_the_leader_dies(cluster):
    leader, follower, _, _ = cluster
    assert admin(leader, "/admin/rollout", {"canary": "v2", "steps": [0.5, 1.0], "step_s": 600}).status_code == 200
    wait_for(lambda: follower.router.rollout.state == "running", 5, "the follower following")
    rollout_id = leader.router.rollout.id
    leader.stop()
    wait_for(lambda: follower.router.leading, DEAD_AFTER_S + 5, "the follower leading",
             state=lambda: follower.router.peers.view())
    status = admin(follower, "/admin/rollout").json()  # answered by itself now
    assert (status["id"], status["state"], status["share"]) == (rollout_id, "running", 0.5)
    assert admin(follower, "/admin/rollout/abort", {}).status_code == 200
    assert follower.router.rollout.state == "aborted"


def test_an_admin_call_before_the_router_knows_its_leader_is_refused_with_retry_after(cluster):
    _, follower, _, _ = cluster
    follower.router.peers.asked_all = False  # as in its first round
    r = admin(follower, "/admin/workers")
    assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
    assert "which router" in r.json()["error"]["message"]


def test_the_cluster_wide_rounds_run_on_the_leader_alone_and_move_when_it_dies(cluster):
    """The P:D controller, hot-spot relief, prefix copies and rollout steps: counted per router."""
    leader, follower, _, _ = cluster
    ran = {id(r): 0 for r in (leader, follower)}
    for r in (leader, follower):
        async def counted(r=r):
            ran[id(r)] += 1
        r.rounds.rebalance = r.rounds.relieve_hot_spots = r.rounds.copy_hot_prefixes = r.rounds.roll_out = counted
    wait_for(lambda: ran[id(leader)] >= 8, 10, "the leader's rounds", state=lambda: ran)
    assert ran[id(follower)] == 0
    leader.stop()
    wait_for(lambda: ran[id(follower)] >= 8, DEAD_AFTER_S + 10, "the follower's rounds once it leads", state=lambda: ran)
