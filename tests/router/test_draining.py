"""A worker whose heartbeat says it is draining is never chosen: not even once, to be refused and
retried elsewhere (the client would not see that, which is why this test counts the worker's own
calls). Its blocks are free at the end, and the other worker's too."""

from __future__ import annotations

import openai

from tests.router_server import MODEL, RouterServer
from tests.wait import wait_for
from tests.worker.cluster import WorkerServer


def test_a_draining_worker_is_never_chosen(tiny_llama, monkeypatch):
    with (WorkerServer(tiny_llama, "both", ["tcp"]) as draining, WorkerServer(tiny_llama, "both", ["tcp"]) as serving,
          RouterServer(tiny_llama) as rs):
        rs.join(draining)
        rs.join(serving)
        calls = []
        real_generate = draining.worker.generate

        async def counted(*args, **kwargs):
            calls.append(args[0])
            return await real_generate(*args, **kwargs)

        monkeypatch.setattr(draining.worker, "generate", counted)
        draining.worker.drain()
        wait_for(lambda: any(e.url == draining.url and e.stats.draining for e in rs.router.registry.workers()), 10,
                 "the router to see the drain in a heartbeat")

        client = openai.OpenAI(base_url=rs.url + "/v1", api_key="unused", max_retries=0)
        for i in range(8):  # prompts of every length: prefix-aware and load-aware routing alike
            out = client.completions.create(model=MODEL, prompt="word " * (1 + 5 * i), max_tokens=3, temperature=0)
            assert out.choices[0].finish_reason == "length"
        assert calls == []
        wait_for(lambda: serving.is_idle() and draining.is_idle(), 10, "both workers idle")
