"""Canary rollouts on a live router with real workers (in this process, on 127.0.0.1): a stable
version (v1) and a canary (v2), each a colocated worker, under a steady load of concurrent
clients (the official `openai` package). A canary whose worker dies is rolled back by itself,
and no client request fails but those the canary held at the moment it died; a slow canary
(its steps slowed by fault injection) misses the TPOT target and is rolled back at its step's
end; a healthy one takes every step and is promoted, and serves alone once v1 is gone."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.router_server import MODEL, RouterServer
from tests.wait import wait_for
from tests.worker.cluster import WorkerServer, prompt

KEY = "admin-key-for-tests"


@pytest.fixture
def versions(tiny_llama):
    stable = WorkerServer(tiny_llama, "both", ["tcp"], worker_args={"version": "v1"})
    canary = WorkerServer(tiny_llama, "both", ["tcp"], worker_args={"version": "v2"}, fault_injection=True)
    try:
        with RouterServer(tiny_llama, admin_key=KEY, lease_s=2.0, slo_tpot_ms=100.0) as rs:
            rs.join(stable)  # the first to register: v1 is stable
            rs.join(canary)
            yield rs, stable, canary
    finally:
        stable.stop()
        canary.stop()


def admin(rs, path: str, body: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    if body is None and path == "/admin/rollout":
        return httpx.get(rs.url + path, headers=headers, timeout=10)
    return httpx.post(rs.url + path, json=body, headers=headers, timeout=10)


class Load:
    """`clients` threads sending completions one after another until stopped: how many failed."""

    def __init__(self, rs, clients: int = 4, max_tokens: int = 6) -> None:
        self.client = openai.OpenAI(base_url=rs.url + "/v1", api_key="none", max_retries=0, timeout=60)
        self.max_tokens, self.stop = max_tokens, threading.Event()
        self.ok = self.failed = 0
        self.pool = ThreadPoolExecutor(clients)
        self.futures = [self.pool.submit(self._run, i) for i in range(clients)]

    def _run(self, seed: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                self.client.completions.create(model=MODEL, prompt=prompt(12 + n % 7, seed=seed), temperature=0,
                                               max_tokens=self.max_tokens, extra_body={"ignore_eos": True})
                self.ok += 1
            except openai.APIError:
                self.failed += 1

    def close(self) -> None:
        self.stop.set()
        for f in self.futures:
            f.result(timeout=120)
        self.pool.shutdown()


class CanaryHeld:
    """Watches the router's live requests in a thread: the ids of those on `version`'s workers, from
    just before the canary dies (requests keep coming between any snapshot and the kill) until closed."""

    def __init__(self, rs, version: str) -> None:
        self.rs, self.version, self.ids, self.stop = rs, version, set(), threading.Event()
        self._look()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _look(self) -> None:
        router = self.rs.router
        for request_id, live in list(router.live.items()):
            worker = router.registry.get(live.worker_id)
            if worker is not None and worker.version == self.version:
                self.ids.add(request_id)

    def _run(self) -> None:
        while not self.stop.wait(0.001):
            self._look()

    def close(self) -> int:
        self.stop.set()
        self.thread.join(timeout=10)
        return len(self.ids)


def judged_under_load(rs, rollout: dict) -> tuple[dict, Load]:
    """Start `rollout`, keep the load on until it is promoted or rolled back: its last status."""
    assert admin(rs, "/admin/rollout", rollout).status_code == 200
    load = Load(rs)
    try:
        wait_for(lambda: admin(rs, "/admin/rollout").json()["state"] != "running", 90, "the canary judged",
                 state=lambda: admin(rs, "/admin/rollout").json())
    finally:
        load.close()
    return admin(rs, "/admin/rollout").json(), load


def test_a_canary_whose_worker_dies_is_rolled_back_and_fails_only_what_it_held(versions):
    rs, stable, canary = versions
    r = admin(rs, "/admin/rollout", {"canary": "v2", "steps": [0.5, 1.0], "step_s": 30, "min_requests": 5,
                                     "min_errors": 2, "lost_s": 1.0})
    assert r.status_code == 200 and r.json()["share"] == 0.5, r.text
    load = Load(rs)
    try:
        wait_for(lambda: load.ok >= 20, 60, "requests on both versions")
        watch = CanaryHeld(rs, "v2")  # every request seen on the canary from now until the rollback
        canary.stop()  # the canary's worker dies, its streams with it
        wait_for(lambda: admin(rs, "/admin/rollout").json()["state"] == "rolled_back", 30, "the rollback",
                 state=lambda: admin(rs, "/admin/rollout").json())
        held = watch.close()
        after = load.ok
        wait_for(lambda: load.ok >= after + 20, 60, "requests after the rollback")
    finally:
        load.close()
    status = admin(rs, "/admin/rollout").json()
    assert status["share"] == 0.0 and status["stable"] == "v1"
    assert load.failed <= held, (load.failed, held)  # none beyond what the canary held when it died
    metrics = httpx.get(rs.url + "/metrics").text
    assert 'pdserve_rollouts_total{outcome="rolled_back"} 1.0' in metrics
    assert 'pdserve_rollout_state{state="rolled_back"} 1.0' in metrics
    assert wait_for(stable.is_idle, 10, "the stable worker idle") is None


def test_a_slow_canary_misses_its_targets_and_is_rolled_back(versions):
    rs, stable, canary = versions
    r = httpx.post(canary.url + "/v1/faults/slow-steps", json={"delay_ms": 150}, timeout=10)
    assert r.status_code == 200
    status, load = judged_under_load(rs, {"canary": "v2", "steps": [0.5, 1.0], "step_s": 2, "min_requests": 4})
    assert status["state"] == "rolled_back" and "SLA attainment" in status["events"][-1]["why"], status
    assert load.failed == 0  # slow, not failing: every request was answered
    for w in (stable, canary):
        assert wait_for(w.is_idle, 10, "workers idle") is None


def test_a_healthy_canary_is_promoted_and_then_serves_alone(versions):
    rs, stable, canary = versions
    status, load = judged_under_load(rs, {"canary": "v2", "steps": [0.25, 1.0], "step_s": 1, "min_requests": 3})
    assert status["state"] == "promoted" and status["stable"] == "v2", status
    assert [e["event"] for e in status["events"]] == ["started", "advanced", "promoted"]
    assert load.failed == 0
    stable.stop()  # the old version leaves: the promoted one serves every request
    r = httpx.post(rs.url + "/v1/completions", json={"model": MODEL, "prompt": prompt(9), "max_tokens": 3},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert wait_for(canary.is_idle, 10, "the canary idle") is None


def test_rollout_commands_are_checked(versions):
    rs, _, _ = versions
    assert admin(rs, "/admin/rollout", {"canary": "v9"}).status_code == 409  # no worker of that version
    bad = admin(rs, "/admin/rollout", {"canary": "v2", "steps": [0.5, 0.2]})
    assert bad.status_code == 400 and "steps" in bad.json()["error"]["message"]
    assert admin(rs, "/admin/rollout", {"canary": "v2", "step_s": -1}).json()["error"]["param"] == "step_s"
    assert admin(rs, "/admin/rollout", {"canary": "../x"}).status_code == 400
    assert admin(rs, "/admin/rollout/pause").status_code == 409  # nothing runs
    assert admin(rs, "/admin/rollout", {"canary": "v2"}).status_code == 200
    assert admin(rs, "/admin/rollout", {"canary": "v2"}).status_code == 409  # one at a time
    assert admin(rs, "/admin/rollout/pause").json()["state"] == "paused"
    assert admin(rs, "/admin/rollout/resume").json()["state"] == "running"
    assert admin(rs, "/admin/rollout/abort").json()["state"] == "aborted"
    assert httpx.get(rs.url + "/admin/rollout").status_code == 401
