"""Shadow traffic on a live router with real workers (in this process, on 127.0.0.1): the stable
version (v1) answers every request; a share is copied to a shadow version (v2: the same
architecture with other weights), whose answers are compared and never returned. Its greedy
tokens' agreement and latency by phase are reported; its concurrency stays within its bound (the
rest skipped and counted); a shadow worker that dies costs no client anything."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve import LLM, SamplingParams
from pdserve.credentials import ADMIN_KEY_ENV
from tests.factories import make_tiny_model
from tests.router_server import MODEL, RouterServer
from tests.wait import wait_for
from tests.worker.cluster import WorkerServer, prompt

KEY = "admin-key-for-tests"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def versions(tiny_llama, tmp_path):
    other = make_tiny_model(tmp_path / "other", "llama", seed=1)  # the shadow's model: other weights
    stable = WorkerServer(tiny_llama, "both", ["tcp"], worker_args={"version": "v1"})
    shadow = WorkerServer(other, "both", ["tcp"], worker_args={"version": "v2"}, fault_injection=True)
    try:
        with RouterServer(tiny_llama, admin_key=KEY, lease_s=2.0) as rs:
            rs.join(stable)
            rs.join(shadow)
            yield rs, stable, shadow, other
    finally:
        stable.stop()
        shadow.stop()


def complete(rs, tokens: list[int], max_tokens: int = 8) -> list[int] | None:
    r = httpx.post(rs.url + "/v1/completions", json={"model": MODEL, "prompt": tokens, "max_tokens": max_tokens,
                                                     "temperature": 0, "ignore_eos": True},
                   timeout=60)
    return r.json()["choices"][0]["text"] if r.status_code == 200 else None


def report(rs) -> dict:
    return httpx.get(rs.url + "/admin/shadow", headers=HEADERS, timeout=10).json()


def test_the_shadow_is_compared_and_never_answers(versions, tiny_llama):
    rs, stable, shadow, other = versions
    r = httpx.post(rs.url + "/admin/shadow", json={"version": "v2", "share": 1.0, "max_concurrency": 4},
                   headers=HEADERS, timeout=10)
    assert r.status_code == 200, r.text
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ours, theirs = LLM(str(tiny_llama), dtype="float32"), LLM(str(other), dtype="float32")
    prompts = [prompt(10 + n, seed=n) for n in range(6)]
    for p in prompts:
        assert complete(rs, p) == ours.generate([{"prompt_token_ids": p}], greedy)[0].outputs[0].text
    wait_for(lambda: report(rs)["compared"] == len(prompts), 30, "every copy compared", state=lambda: report(rs))
    got = report(rs)
    assert got["mirrored"] == len(prompts) and got["shadow_failed"] == got["primary_failed"] == 0
    assert got["greedy_compared"] == len(prompts)
    # what agreement the two models' greedy tokens really have, from the start
    expected = []
    for p in prompts:
        a = ours.generate([{"prompt_token_ids": p}], greedy)[0].outputs[0].token_ids
        b = theirs.generate([{"prompt_token_ids": p}], greedy)[0].outputs[0].token_ids
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        expected.append(same / len(a))
    assert got["greedy_agreement_mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-4)
    assert got["greedy_identical"] == sum(e == 1.0 for e in expected) < len(prompts)
    medians = got["latency_medians"]
    assert medians["ttft_s"]["primary"] > 0 and medians["e2e_s"]["shadow"] > 0 and "decode_s" in medians
    metrics = httpx.get(rs.url + "/metrics").text
    assert f'pdserve_shadow_requests{{outcome="compared"}} {float(len(prompts))}' in metrics
    stop = httpx.post(rs.url + "/admin/shadow/stop", headers=HEADERS, timeout=10)
    assert stop.status_code == 200 and stop.json()["compared"] == len(prompts)
    assert httpx.get(rs.url + "/admin/shadow", headers=HEADERS).status_code == 404
    for w in (stable, shadow):
        assert wait_for(w.is_idle, 10, "workers idle") is None


def test_the_shadow_s_concurrency_is_bounded_and_its_failures_are_its_own(versions):
    rs, stable, shadow, _ = versions
    assert httpx.post(shadow.url + "/v1/faults/slow-steps", json={"delay_ms": 60}).status_code == 200
    assert httpx.post(rs.url + "/admin/shadow", json={"version": "v2", "share": 1.0, "max_concurrency": 1},
                      headers=HEADERS).status_code == 200
    most, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            if rs.router.shadow is not None:
                most[0] = max(most[0], rs.router.shadow.in_flight)
            time.sleep(0.002)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda n: complete(rs, prompt(12, seed=n), 6), range(16)))
    finally:
        stop.set()
        watcher.join()
    assert all(a is not None for a in answers)
    got = report(rs)
    assert most[0] == 1 and got["skipped_busy"] > 0 and got["mirrored"] + got["skipped_busy"] == 16
    shadow.stop()  # the shadow's worker dies: copies fail, clients do not
    after = [complete(rs, prompt(14, seed=n), 4) for n in range(4)]
    assert all(a is not None for a in after)
    got = report(rs)
    assert got["shadow_failed"] + got["skipped_no_worker"] >= 1 and got["primary_failed"] == 0
    assert wait_for(stable.is_idle, 10, "the stable worker idle") is None


def test_shadow_commands_are_checked(versions):
    rs, _, _, _ = versions
    post = lambda body: httpx.post(rs.url + "/admin/shadow", json=body, headers=HEADERS)  # noqa: E731
    assert post({"version": "v1"}).status_code == 409  # the stable version
    assert post({"version": "v9"}).status_code == 409  # no worker of it
    assert post({"version": "v2", "share": 1.5}).json()["error"]["param"] == "share"
    assert post({"version": "v2", "max_concurrency": 0}).status_code == 400
    assert httpx.post(rs.url + "/admin/shadow/stop", headers=HEADERS).status_code == 404
    assert httpx.post(rs.url + "/admin/shadow", json={"version": "v2"}).status_code == 401


def test_the_report_command_shows_the_comparison(versions):
    rs, _, _, _ = versions
    assert httpx.post(rs.url + "/admin/shadow", json={"version": "v2", "share": 1.0}, headers=HEADERS).status_code == 200
    for n in range(3):
        assert complete(rs, prompt(10, seed=n)) is not None
    wait_for(lambda: report(rs)["compared"] == 3, 30, "the copies compared")
    env = {**os.environ, ADMIN_KEY_ENV: KEY}
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", "shadow-report", "--router", rs.url], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "shadow version v2: 100% of requests" in done.stdout and "mirrored 3  compared 3" in done.stdout
    assert "ttft_s" in done.stdout and "greedy token agreement" in done.stdout
    refused = subprocess.run([sys.executable, "-m", "pdserve.cli", "shadow-report", "--router", rs.url],
                             env={k: v for k, v in env.items() if k != ADMIN_KEY_ENV}, capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 1 and "admin key" in refused.stderr
