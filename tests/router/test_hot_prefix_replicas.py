"""Hot-prefix replicas end to end: a burst of requests sharing one long prefix piles onto the decode
worker that holds it (routing prefers the worker whose prefix cache holds the prompt); the router
sees the prefix's rate, copies its KV from that worker to the other decode workers through the
transfer engine, and the next burst spreads over all of them, the prefix computed once in the
whole cluster. Every completion is the offline engine's text; no block leaks; as the prefix cools
the copies are dropped."""

from __future__ import annotations

import concurrent.futures

import openai

from tests.factories import make_llm, offline_text
from tests.router_server import RouterServer
from tests.wait import wait_for
from tests.worker.cluster import WorkerServer

BLOCK = 8
SHARED = "You are a careful assistant who answers questions about ships, harbours and the sea. " * 2
QUESTIONS = [f"Question {i}: which ship left port number {i} first?" for i in range(13)]
MAX_TOKENS = 6


def test_a_hot_prefix_burst_spreads_over_copies_without_recomputing_it(tiny_llama):
    with (WorkerServer(tiny_llama, "decode", ["tcp"], block_size=BLOCK) as a,
          WorkerServer(tiny_llama, "decode", ["tcp"], block_size=BLOCK) as b,
          WorkerServer(tiny_llama, "decode", ["tcp"], block_size=BLOCK) as c,
          RouterServer(tiny_llama, lease_s=2.0, hot_prefix_rate=0.2, hot_prefix_window_s=4.0) as rs):
        workers = [a, b, c]
        for w in workers:
            rs.join(w)
        router = rs.router
        client = openai.OpenAI(base_url=rs.url + "/v1", api_key="none", max_retries=0, timeout=120)
        offline = make_llm(tiny_llama, block_size=BLOCK)
        prompts = [SHARED + q for q in QUESTIONS]
        expected = {p: offline_text(offline, p, MAX_TOKENS, ignore_eos=True) for p in prompts}

        def complete(prompt: str) -> str:
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
            return r.choices[0].text

        def burst(batch: list[str]) -> list[str]:
            with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
                return list(pool.map(complete, batch))

        def served() -> list[int]:  # the prompt tokens of clients' requests each worker served (a copy's
            # tokens on the worker it was copied to are all transferred)
            return [sum(w.worker.stats().tokens_by_source[k] for k in ("computed", "prefix_cache")) for w in workers]

        copied = lambda: router.metrics.prefix_copies.labels("copied")._value.get()  # noqa: E731
        assert complete(prompts[0]) == expected[prompts[0]]  # the first: its worker computes the prefix
        holder = next(w for w, n in zip(workers, served()) if n)
        texts = burst(prompts[1:7])  # the burst piles onto the holder: the others hold nothing
        assert [w for w, n in zip(workers, served()) if n] == [holder]
        wait_for(lambda: copied() >= 2, 30, "the hot prefix copied to the two other workers",
                 state=lambda: (router.metrics.prefix_copies.labels("failed")._value.get(), served()))
        before = served()
        texts += burst(prompts[7:])  # now spread over every holder by load
        after = served()
        assert sum(x > y for x, y in zip(after, before)) >= 2, (before, after)
        assert [expected[p] for p in prompts[1:]] == texts

        stats = [w.worker.stats() for w in workers]
        computed = sum(s.tokens_by_source["computed"] for s in stats)
        encoded = [offline.get_tokenizer().encode(p) for p in prompts]
        common = next(i for i, column in enumerate(zip(*encoded)) if len(set(column)) > 1)
        ids, shared_blocks = [len(e) for e in encoded], common // BLOCK * BLOCK
        # the shared blocks once (the first request), every prompt's own tokens, the token each
        # copy's source computed past the blocks; nothing else
        assert computed <= ids[0] + sum(n - shared_blocks for n in ids[1:]) + 2, (computed, stats)
        copies = [s for w, s in zip(workers, stats) if w is not holder]
        assert all(s.tokens_by_source["transferred"] >= shared_blocks for s in copies)  # from the holder
        assert sum(s.tokens_by_source["prefix_cache"] for s in copies) > 0  # and served from there

        wait_for(lambda: router.metrics.prefix_copies_held._value.get() == 0, 60, "the copies dropped as it cooled",
                 state=lambda: router.replicas.copies)
        assert router.metrics.prefix_copies.labels("dropped")._value.get() == copied()
        for w in workers:
            wait_for(w.is_idle, 10, "every worker idle, its blocks all free", state=w.worker.stats)
        assert not router.live and router.admission.requests == 0
