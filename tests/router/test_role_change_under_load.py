"""A live role change under load: a decode worker becomes a prefill worker while greedy requests
are mid-decode on it and on the other decode worker, and more keep arriving. Every request
completes with exactly the tokens the colocated engine gives its prompt, and afterwards every
worker is idle with all its KV blocks free."""

from __future__ import annotations

import concurrent.futures

import httpx

from pdserve import SamplingParams
from pdserve.router.policy import DisaggregationPolicy, HotSpotRelief
from tests.factories import make_llm
from tests.router_server import RouterServer
from tests.wait import wait_for
from tests.worker.cluster import WorkerServer, prompt

KEY = "admin-" + "r" * 32
MAX_TOKENS = 500  # long enough that the first wave is still decoding when the change starts
REMOTE_PREFILL_TOKENS = 64  # prompts at least this long go through a prefill worker
# before the change: long prompts (prefilled by the prefill worker) and short ones (by decode)
FIRST_WAVE = [prompt(160, seed=i) if i % 2 == 0 else prompt(24, seed=i) for i in range(6)]
# asked while the worker drains, and once it serves in its new role
DURING_CHANGE = [prompt(120, seed=10 + i) for i in range(2)]
AFTER_CHANGE = [prompt(200, seed=20 + i) for i in range(3)]


def test_a_decode_worker_turns_prefill_mid_decode_and_no_request_changes(tiny_llama):
    offline = make_llm(tiny_llama)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    everything = FIRST_WAVE + DURING_CHANGE + AFTER_CHANGE
    expected = [(o.outputs[0].text, len(o.outputs[0].token_ids))
                for o in offline.generate([{"prompt_token_ids": p} for p in everything], greedy)]

    with (WorkerServer(tiny_llama, "prefill", ["tcp"]) as pre,
          WorkerServer(tiny_llama, "decode", ["tcp"], block_size=8) as flips,
          WorkerServer(tiny_llama, "decode", ["tcp"], block_size=8) as other,
          RouterServer(tiny_llama, admin_key=KEY, lease_s=1.5,
                       disaggregation=DisaggregationPolicy(min_remote_tokens=REMOTE_PREFILL_TOKENS),
                       relief=HotSpotRelief(min_remaining_tokens=16)) as rs):
        workers = (pre, flips, other)
        rs.join(pre)
        rs.join(flips)  # the only decode worker at first: the first requests all start on it

        def complete(tokens: list[int]) -> tuple[str, int]:
            body = {"model": "tiny", "prompt": tokens, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True}
            r = httpx.post(rs.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]

        def roles() -> dict[str, str]:
            return {w.url: w.role for w in rs.router.registry.workers()}

        def running() -> str:
            return ", ".join(f"{w.worker.role}: {w.worker.stats().running} running" for w in workers)

        with concurrent.futures.ThreadPoolExecutor(len(everything)) as pool:
            on_flips = [pool.submit(complete, p) for p in FIRST_WAVE[:4]]
            wait_for(lambda: flips.worker.stats().running == 4, 30, "four requests decoding on the worker that "
                     "will change", state=running)
            rs.join(other)
            on_other = [pool.submit(complete, p) for p in FIRST_WAVE[4:]]
            wait_for(lambda: other.worker.stats().running == 2, 30, "two requests decoding on the other",
                     state=running)

            wid = next(w.worker_id for w in rs.router.registry.workers() if w.url == flips.url)
            r = httpx.post(rs.url + f"/admin/workers/{wid}/role", json={"role": "prefill"},
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
            assert r.status_code == 200, r.text
            # the change began with requests mid-decode on it (the worker drains on a thread of its
            # own, started as it answers; relief then moves one request per heartbeat): they
            # finish or move, none is lost
            wait_for(lambda: flips.worker.draining, 10, "the worker to start draining")
            assert flips.worker.stats().running > 0
            during = [pool.submit(complete, p) for p in DURING_CHANGE]

            wait_for(lambda: roles() == {pre.url: "prefill", flips.url: "prefill", other.url: "decode"}, 60,
                     "the worker registered as prefill", state=lambda: (roles(), running()))
            assert flips.worker.role == "prefill" and not flips.worker.draining
            landed = other.worker.stats().kv_landed
            after = [pool.submit(complete, p) for p in AFTER_CHANGE]
            answers = [f.result(timeout=120) for f in on_flips + on_other + during + after]

        assert answers == expected  # greedy: the same tokens as the colocated engine, none lost or repeated
        assert other.worker.stats().kv_landed >= landed + len(AFTER_CHANGE)  # prefilled by P workers
        wait_for(lambda: all(w.is_idle() for w in workers), 15, "every worker idle, every KV block free",
                 state=lambda: [w.worker.stats() for w in workers])
        assert not rs.router.live and rs.router.admission.requests == 0
