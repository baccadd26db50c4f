"""`pdserve worker` as real processes: a prefill and a decode worker on 127.0.0.1, the prefill
worker killed outright, the decode worker stopped by SIGTERM."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest

from pdserve import SamplingParams
from pdserve.kv_transfer.shm import reap_stale_pools
from tests.factories import make_llm
from tests.wait import wait_for
from tests.worker.cluster import CASES, prompt
from tests.worker.processes import AUTH, spawn


def test_workers_as_processes(tiny_llama):
    tokens = prompt(45, seed=11)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = make_llm(tiny_llama).generate({"prompt_token_ids": tokens}, sp)[0].outputs[0].token_ids
    p, p_ready = spawn(tiny_llama, "prefill")
    d, d_ready = spawn(tiny_llama, "decode", "--transfer", "shm,tcp")
    try:
        body = {"prompt_token_ids": tokens, "prefill_url": p_ready["url"], "stream": False,
                "sampling": {"temperature": 0, "max_tokens": 8, "ignore_eos": True}}
        with httpx.Client(timeout=60, headers=AUTH) as http:
            got = http.post(d_ready["url"] + "/v1/generate", json=body).json()
            assert [t for line in got for t in line["outputs"][0]["token_ids"]] == expected
            assert http.get(d_ready["url"] + "/stats").json()["kv_landed"] == 1
            assert "pdserve_worker_kv_landed 1.0" in http.get(d_ready["url"] + "/metrics").text

            p.kill()  # the prefill worker dies without a word
            p.wait(10)
            got = http.post(d_ready["url"] + "/v1/generate", json=body).json()
            assert [t for line in got for t in line["outputs"][0]["token_ids"]] == expected
            stats = http.get(d_ready["url"] + "/stats").json()
            assert stats["kv_recomputed"] == 1 and stats["kv_blocks_used"] == 0
        pool = d_ready["kv"]["shm"]["path"]
        assert os.path.exists(pool)
        d.send_signal(signal.SIGTERM)
        assert d.wait(20) == 0
        assert not os.path.exists(pool)  # the shared pool went with it
    finally:
        for proc in (p, d):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        reap_stale_pools()  # what the killed ones could not remove


def poll(url: str, predicate, what: str) -> dict:
    """The worker's stats once `predicate` holds of them; polled often, for states that last milliseconds."""
    seen: dict = {}

    def reached() -> bool:
        seen["stats"] = httpx.get(url + "/stats", timeout=5, headers=AUTH).json()
        return predicate(seen["stats"])
    wait_for(reached, 30, what, state=lambda: seen["stats"], interval=0.003)
    return seen["stats"]


@pytest.mark.parametrize("backend", CASES)
def test_processes_killed_mid_transfer(tiny_llama, backend):
    """SIGKILL the prefill worker while a prompt's KV is landing: decode recomputes it, output
    intact. Then SIGKILL the decode worker mid-transfer: the prefill worker frees everything."""
    tokens = prompt(600, seed=12)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = make_llm(tiny_llama).generate({"prompt_token_ids": tokens}, sp)[0].outputs[0].token_ids
    # 150 prefill steps: a wide window to stop it in. Kept as a race on purpose: the prefill worker
    # is another process, whose engine a test cannot hold; the check after SIGSTOP says if it was missed.
    slow = ["--max-num-batched-tokens", "4"]
    procs = []
    try:
        p, p_ready = spawn(tiny_llama, "prefill", "--transfer", backend, *slow)
        d, d_ready = spawn(tiny_llama, "decode", "--transfer", backend)
        procs += [p, d]
        body = {"prompt_token_ids": tokens, "prefill_url": p_ready["url"], "stream": False,
                "sampling": {"temperature": 0, "max_tokens": 6, "ignore_eos": True}}
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(
            r=httpx.post(d_ready["url"] + "/v1/generate", json=body, timeout=120, headers=AUTH)))
        t.start()
        poll(d_ready["url"], lambda s: s["kv_bytes_received"] > 0 and s["waiting_for_kv"] == 1,
             "the first of the prompt's KV on the decode worker")
        p.send_signal(signal.SIGSTOP)  # frozen mid-transfer: check that it is, then kill it
        assert httpx.get(d_ready["url"] + "/stats", headers=AUTH).json()["kv_landed"] == 0, "prefill finished too soon"
        p.kill()
        t.join(60)
        assert not t.is_alive(), "the request had not ended after 60s"
        got = box["r"].json()
        assert [t for line in got for t in line["outputs"][0]["token_ids"]] == expected
        stats = poll(d_ready["url"], lambda s: s["kv_blocks_used"] == 0, "every decode block free")
        assert stats["kv_recomputed"] == 1 and stats["kv_landed"] == 0

        p2, p2_ready = spawn(tiny_llama, "prefill", "--transfer", backend, *slow)
        procs.append(p2)
        body["prefill_url"] = p2_ready["url"]
        body["prompt_token_ids"] = prompt(600, seed=13)  # not in decode's prefix cache
        def doomed() -> None:  # its decode worker is about to be killed
            try:
                httpx.post(d_ready["url"] + "/v1/generate", json=body, timeout=120, headers=AUTH)
            except httpx.HTTPError:
                pass
        threading.Thread(target=doomed, daemon=True).start()
        poll(p2_ready["url"], lambda s: s["kv_bytes_sent"] > 0 and s["running"] == 1,
             "the prefill worker sending KV")
        d.kill()
        poll(p2_ready["url"], lambda s: s["running"] == 0 and s["waiting"] == 0 and s["kv_blocks_used"] == 0,
             "an idle prefill worker")
        if "shm" in d_ready["kv"]:  # the killed worker could not remove its pool: the next one on this host does
            d.wait(10)
            reap_stale_pools()
            assert not os.path.exists(d_ready["kv"]["shm"]["path"])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        reap_stale_pools()  # what the killed ones could not remove
