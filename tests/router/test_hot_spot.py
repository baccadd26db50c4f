"""Hot-spot relief end to end: requests running on a decode worker past the hot KV threshold move
to a cooler one, their KV sent by the hot worker through the transfer engine, and every client
stream goes on with exactly the text an uninterrupted run gives."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from pdserve.router.policy import HotSpotRelief
from tests.factories import make_llm, offline_text
from tests.router_server import RouterServer
from tests.wait import wait_for
from tests.worker.cluster import WorkerServer

PROMPTS = [f"request {i} tells a long story about ships and the sea " * 2 for i in range(3)]
MAX_TOKENS = 300


@pytest.fixture()
def two_decoders(tiny_llama):
    with (WorkerServer(tiny_llama, "decode", ["tcp"], block_size=8, kv_cache_memory="1MiB") as hot,
          WorkerServer(tiny_llama, "decode", ["tcp"], block_size=8) as cool,
          RouterServer(tiny_llama, lease_s=1.5, hot_kv_usage=0.25,
                       relief=HotSpotRelief(target_max_kv_usage=0.2, min_remaining_tokens=16)) as rs):
        yield rs.router, rs.url, hot, cool, rs.join


def slow_until_moved(server: WorkerServer, moved, monkeypatch) -> None:
    """The worker decodes slowly until relief has moved a request, so that the requests outlast
    relief's first rounds (heartbeats every half second) on any machine, slow or fast; otherwise
    they could end before there was anything to move. Nothing here is timed."""
    step = server.worker.engine.step

    def step_until_relief():
        if not moved():
            time.sleep(0.02)
        return step()

    monkeypatch.setattr(server.worker.engine, "step", step_until_relief)


def complete(url: str, prompt: str) -> str:
    """One greedy completion of MAX_TOKENS (EOS ignored) through the router at `url`: its text."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_requests_move_off_a_hot_decode_worker_without_a_gap(tiny_llama, two_decoders, monkeypatch):
    router, url, hot, cool, register = two_decoders
    offline = make_llm(tiny_llama)
    expected = [offline_text(offline, p, MAX_TOKENS, ignore_eos=True) for p in PROMPTS]
    register(hot)  # alone at first: every request starts there
    moved = lambda: router.metrics.migrations.labels("hot_spot")._value.get()  # noqa: E731
    slow_until_moved(hot, moved, monkeypatch)

    def stream(prompt: str) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True}
        texts = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line.removeprefix("data: "))
                    assert "error" not in chunk, chunk
                    texts.append(chunk["choices"][0]["text"])
        return "".join(texts)

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(stream, p) for p in PROMPTS]
        wait_for(lambda: hot.worker.stats().running >= len(PROMPTS), 30, "the requests to start")
        register(cool)  # now there is somewhere to go
        texts = [f.result(timeout=120) for f in futures]

    assert texts == expected  # greedy: the same text, no token twice, none missing
    assert moved() >= 1
    stats = cool.worker.stats()
    assert stats.kv_landed == moved() and stats.kv_recomputed == 0  # the KV came from the hot worker
    assert hot.worker.stats().kv_notified == moved()
    wait_for(lambda: hot.is_idle() and cool.is_idle(), 10, "both workers idle",
             state=lambda: (hot.worker.stats(), cool.worker.stats()))
    assert not router.live and router.admission.requests == 0


def test_a_draining_decode_worker_hands_its_requests_over_with_their_kv(tiny_llama, monkeypatch):
    """Draining makes a worker look full to hot-spot relief: its running requests move to another
    decode worker, which takes their KV from it, and every stream goes on with the same text."""
    offline = make_llm(tiny_llama)
    expected = [offline_text(offline, p, MAX_TOKENS, ignore_eos=True) for p in PROMPTS]
    with (WorkerServer(tiny_llama, "decode", ["tcp"], block_size=8) as draining,
          WorkerServer(tiny_llama, "decode", ["tcp"], block_size=8) as other,
          RouterServer(tiny_llama, lease_s=1.5, relief=HotSpotRelief(min_remaining_tokens=16)) as rs):
        rs.join(draining)  # alone at first: every request starts there
        moved = lambda: rs.router.metrics.migrations.labels("hot_spot")._value.get()  # noqa: E731
        slow_until_moved(draining, moved, monkeypatch)

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(complete, rs.url, p) for p in PROMPTS]
            wait_for(lambda: draining.worker.stats().running >= len(PROMPTS), 30, "the requests to start")
            rs.join(other)
            draining.worker.drain()
            texts = [f.result(timeout=120) for f in futures]

        assert texts == expected
        assert moved() >= 1 and other.worker.stats().kv_landed == moved()  # the KV came from the draining one
        assert draining.worker.stats().kv_notified == moved()
        r = httpx.post(draining.url + "/v1/generate", json={"prompt_token_ids": [1, 2, 3]})
        assert r.status_code == 503 and "draining" in r.json()["error"]["message"]  # nothing new is taken
        wait_for(lambda: draining.is_idle() and other.is_idle(), 10, "both workers idle")
        assert draining.worker.idle() and not rs.router.live


def test_the_leader_relieves_a_hot_worker_of_the_streams_another_router_follows(tiny_llama, monkeypatch):
    """Router replicas: the requests run through the follower only; the leader's relief chooses the
    moves and the follower carries them out, each stream going on with the same text."""
    from pdserve.router.peers import Peers

    offline = make_llm(tiny_llama)
    expected = [offline_text(offline, p, MAX_TOKENS, ignore_eos=True) for p in PROMPTS]
    relief = dict(lease_s=1.5, hot_kv_usage=0.25, relief=HotSpotRelief(target_max_kv_usage=0.2, min_remaining_tokens=16))
    with (WorkerServer(tiny_llama, "decode", ["tcp"], block_size=8, kv_cache_memory="1MiB") as hot,
          WorkerServer(tiny_llama, "decode", ["tcp"], block_size=8) as cool,
          RouterServer(tiny_llama, **relief) as a, RouterServer(tiny_llama, **relief) as b):
        for r in (a, b):
            r.router.peers = Peers(r.url, [a.url, b.url])
        both = f"{a.url},{b.url}"
        a.members.append(hot.worker.join(both, hot.url, ""))
        wait_for(lambda: sorted(r.router.leading for r in (a, b)) == [False, True], 15, "one leader")
        leader, follower = (a, b) if a.router.leading else (b, a)
        moved = lambda: follower.router.metrics.migrations.labels("hot_spot")._value.get()  # noqa: E731
        slow_until_moved(hot, moved, monkeypatch)

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(complete, follower.url, p) for p in PROMPTS]
            wait_for(lambda: hot.worker.stats().running >= len(PROMPTS), 30, "the requests to start")
            a.members.append(cool.worker.join(both, cool.url, ""))  # now there is somewhere to go
            texts = [f.result(timeout=120) for f in futures]

        assert texts == expected
        assert moved() >= 1 and cool.worker.stats().kv_landed == moved()  # the KV came from the hot worker
        assert leader.router.metrics.migrations.labels("hot_spot")._value.get() == 0  # it had no stream to move
        assert not follower.router.live and not leader.router.live
