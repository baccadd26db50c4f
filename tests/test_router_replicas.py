"""Router replicas under `pdserve serve --routers 2`: two router processes on one address
(SO_REUSEPORT), every worker registered with both, exactly one leading. One SIGKILLed under a
load of concurrent clients (the official `openai` package): every request that started after the
kill is answered, and the killed one comes back on the same address (its own too) and registered
with every worker again; one router leads again, never two at once (the first-sorting one leads,
once it has asked the others and heard the workers' heartbeats)."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from pdserve.credentials import ADMIN_KEY_ENV, TOKEN_ENV
from tests.serve_process import ServeProcess
from tests.wait import wait_for
from tests.worker.cluster import prompt


ADMIN_KEY = "admin-" + "k" * 32


def admin_workers(url: str) -> tuple[tuple[str, str], ...]:
    r = httpx.get(url + "/admin/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    assert r.status_code == 200, r.text
    return tuple(sorted((w["id"], w["url"]) for w in r.json()["workers"]))


def leading(routers: list[dict]) -> list[bool | None]:
    out = []
    for r in routers:
        try:
            out.append(httpx.get(r["internal_url"] + "/health", timeout=2).json()["leading"])
        except httpx.HTTPError:
            out.append(None)
    return out


def test_two_routers_one_killed_under_load(tiny_llama):
    cluster = ServeProcess("--model", str(tiny_llama), "--port", "0", "--prefill", "1", "--decode", "1",
                           "--routers", "2", "--dtype", "float32", "--block-size", "4", "--kv-cache-memory", "8MiB",
                           "--max-restart-backoff", "0.5", env={**os.environ, TOKEN_ENV: "t" * 48,
                                                                ADMIN_KEY_ENV: ADMIN_KEY})
    try:
        wait_for(lambda: cluster.event("ready") or cluster.proc.poll() is not None, 240, "the cluster",
                 state=lambda: cluster.log[-5:])
        ready = cluster.event("ready")
        assert ready is not None, cluster.log[-20:]
        routers = [p for p in ready["processes"] if p["name"].startswith("router")]
        assert [r["name"] for r in routers] == ["router 0", "router 1"]
        assert {r["url"] for r in routers} == {ready["url"]}  # one address
        for r in routers:  # each has every worker
            assert httpx.get(r["internal_url"] + "/health").json()["workers"] == 2
        wait_for(lambda: sorted(leading(routers)) == [False, True], 15, "one leader", state=lambda: leading(routers))
        # admin calls are the leader's whichever router they reach: its worker ids, from each router's own
        # address and from the shared one (where the kernel picks the router)
        answers = {admin_workers(u) for u in [*(r["internal_url"] for r in routers), *[ready["url"]] * 6]}
        assert len(answers) == 1 and len(next(iter(answers))) == 2, answers
        for r, leads in zip(routers, leading(routers)):  # the follower passed it on
            passed = httpx.get(r["internal_url"] + "/admin/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            assert passed.headers.get("X-Pdserve-Forwarded") == (None if leads else "1"), r["name"]

        client = openai.OpenAI(base_url=ready["url"] + "/v1", api_key="none", max_retries=0, timeout=60)
        outcomes: list[tuple[float, str]] = []  # (when it started, "" if answered, else the error)
        stop = threading.Event()

        def run(seed: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                started = time.monotonic()
                try:
                    client.completions.create(model=ready["model"], prompt=prompt(10 + n % 5, seed=seed),
                                              max_tokens=6, extra_body={"ignore_eos": True})
                    outcomes.append((started, ""))
                except openai.APIError as e:
                    outcomes.append((started, f"{type(e).__name__}: {e}"))

        pool = ThreadPoolExecutor(4)
        futures = [pool.submit(run, i) for i in range(4)]
        try:
            wait_for(lambda: len(outcomes) >= 20, 60, "requests through both routers", state=lambda: outcomes[-3:])
            leader = routers[leading(routers).index(True)]
            os.kill(leader["pid"], signal.SIGKILL)
            # from when its supervisor saw it gone: its sockets are closed by then (a connection the
            # kernel gave its listener, or a request sent on a connection to it, before that was its own)
            wait_for(lambda: cluster.event("exited", leader["name"]), 10, "the killed router's exit")
            killed_at = time.monotonic()
            seen = []  # which routers said they lead, sampled until the killed one is back and leads or follows
            before = len(outcomes)
            wait_for(lambda: len(outcomes) >= before + 30, 60, "requests after the kill")
            wait_for(lambda: cluster.event("ready_again", leader["name"]), 60, "the killed router back")
            wait_for(lambda: seen.append(leading(routers)) or sorted(seen[-1], key=str) == [False, True], 30,
                     "one leader again", state=lambda: seen[-3:], interval=0.2)
        finally:
            stop.set()
            for f in futures:
                f.result(timeout=90)
            pool.shutdown()
        after = [error for started, error in outcomes if started > killed_at]
        failed = [e for e in after if e]
        assert after and not failed, f"{len(failed)} of {len(after)} requests begun after the kill failed: {failed[:3]}"
        assert not any(sample.count(True) > 1 for sample in seen), seen  # never two leaders at once
        assert httpx.get(leader["internal_url"] + "/health").json()["workers"] == 2  # registered with it again
    finally:
        cluster.close()
