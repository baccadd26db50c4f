"""Disaggregated greedy output equals colocated greedy output, token for token, on every backend."""

from __future__ import annotations

import pytest

from pdserve import SamplingParams
from tests.factories import make_llm
from tests.worker.cluster import CASES_WITH_MEMORY, Cluster, prompt

LENGTHS = [3, 5, 9, 16, 17, 23, 31, 32, 33, 47, 64, 65, 90, 111, 128, 150]


@pytest.fixture(scope="module")
def colocated(tiny_llama):
    return make_llm(tiny_llama, block_size=4)


def reference(llm, prompts, max_tokens=8, **sampling):
    sp = SamplingParams(**{"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, **sampling})
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


@pytest.mark.parametrize("backend", CASES_WITH_MEMORY)
def test_sixteen_prompts_match_colocated(tiny_llama, colocated, backend):
    prompts = [prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    expected = reference(colocated, prompts)
    # prefill chunks of 32 tokens, block size 4 on prefill and 8 on decode
    with Cluster(tiny_llama, backend) as c:
        assert c.generate_many(prompts) == expected
        c.wait_idle()
        stats = c.d.worker.stats()
        assert stats.kv_landed == len(prompts) and stats.kv_recomputed == 0
        assert stats.kv_bytes_received == sum(LENGTHS) * c.d.worker.layout.slot_bytes * c.d.worker.layout.num_layers


@pytest.mark.parametrize("backend", CASES_WITH_MEMORY)
def test_multi_turn_sends_only_what_decode_lacks(tiny_llama, colocated, backend):
    turn1 = prompt(40, seed=7)
    with Cluster(tiny_llama, backend) as c:
        out1, last1 = c.generate(turn1)
        assert out1 == reference(colocated, [turn1])[0]
        phases = last1["phase_times"]  # the prefill worker reported its compute time in its notify
        assert set(phases) == {"queue_s", "prefill_s", "transfer_s", "decode_s"}
        assert phases["prefill_s"] > 0 and phases["transfer_s"] >= 0 and phases["decode_s"] > 0
        received = c.d.worker.stats().kv_bytes_received
        turn2 = turn1 + out1 + prompt(12, seed=8)
        out2, last = c.generate(turn2)
        assert out2 == reference(colocated, [turn2])[0]
        assert last["num_cached_tokens"] >= 40  # decode's own prefix cache held turn 1
        sent = c.d.worker.stats().kv_bytes_received - received
        per_token = c.d.worker.layout.slot_bytes * c.d.worker.layout.num_layers
        assert sent == (len(turn2) - last["num_cached_tokens"]) * per_token
        stats = c.d.worker.stats()
        assert stats.kv_landed == 2 and stats.kv_recomputed == 0  # the KV came, nothing recomputed
        c.wait_idle()


def test_prefill_ships_kv_from_its_own_prefix_cache(tiny_llama, colocated):
    # decode caches nothing, prefill hits its cache on the second request: that KV is sent from the cache
    shared = prompt(48, seed=3)
    prompts = [shared + prompt(5, seed=4), shared + prompt(9, seed=5)]
    with Cluster(tiny_llama, "tcp", decode={"enable_prefix_caching": False}) as c:
        for p in prompts:
            assert c.generate(p)[0] == reference(colocated, [p])[0]
        assert c.p.worker.engine.scheduler.num_preemptions == 0
        assert c.d.worker.stats().kv_landed == 2
        c.wait_idle()


def test_seeded_sampling_matches_colocated(tiny_llama, colocated):
    prompts = [prompt(n, seed=n) for n in (7, 30, 61)]
    sampling = dict(temperature=0.9, top_p=0.9, seed=1234)
    expected = reference(colocated, prompts, max_tokens=10, **sampling)
    with Cluster(tiny_llama, "memory") as c:
        assert [c.generate(p, max_tokens=10, **sampling)[0] for p in prompts] == expected
        assert c.d.worker.stats().kv_landed == len(prompts)
        c.wait_idle()


@pytest.mark.parametrize("backend", ["tcp", "memory"])
def test_penalties_and_biases_match_colocated(tiny_llama, colocated, backend):
    """The prefill worker samples the first token, the decode worker the rest: both apply the same
    penalties from the same counts, so the output is the colocated one."""
    prompts = [prompt(n, seed=n) for n in (7, 30, 61)]
    for sampling in (dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={3: 4.0, 9: -100.0}),
                     dict(temperature=0.8, seed=99, repetition_penalty=1.4, presence_penalty=-0.3)):
        expected = reference(colocated, prompts, max_tokens=10, **sampling)
        assert expected != reference(colocated, prompts, max_tokens=10)  # the penalties change the answers
        with Cluster(tiny_llama, backend) as c:
            assert [c.generate(p, max_tokens=10, **sampling)[0] for p in prompts] == expected
            assert c.d.worker.stats().kv_landed == len(prompts)
            c.wait_idle()


def streamed_logprobs(c: Cluster, tokens: list[int], **sampling) -> tuple[list[int], list]:
    out, entries = [], []
    for line in c.stream(tokens, **sampling):
        for delta in line["outputs"]:
            out += delta["token_ids"]
            entries += delta["logprobs"] or []
    return out, entries


@pytest.mark.parametrize("backend", CASES_WITH_MEMORY)
def test_logprobs_match_colocated(tiny_llama, colocated, backend):
    """The prefill worker computes the first token's log-probabilities, and they travel with it
    to the decode worker; nothing is computed twice, and every token has its entry."""
    prompts = [prompt(n, seed=n) for n in (7, 30)]
    for sampling in (dict(logprobs=3), dict(temperature=0.8, seed=7, logprobs=0)):
        sp = SamplingParams(**{"temperature": 0, "max_tokens": 6, "ignore_eos": True, **sampling})
        expected = [o.outputs[0] for o in colocated.generate([{"prompt_token_ids": p} for p in prompts], sp)]
        with Cluster(tiny_llama, backend) as c:
            for p, want in zip(prompts, expected):
                tokens, entries = streamed_logprobs(c, p, max_tokens=6, **sampling)
                assert tokens == want.token_ids and [e[0] for e in entries] == tokens
                for (token, logprob, top), ref in zip(entries, want.logprobs):
                    assert logprob == pytest.approx(ref.logprob, abs=1e-4)
                    assert [t for t, _ in top] == [t for t, _ in ref.top]
            assert c.d.worker.stats().kv_landed == len(prompts) and c.d.worker.stats().kv_recomputed == 0
            c.wait_idle()


@pytest.mark.parametrize("backend", CASES_WITH_MEMORY)
def test_prompt_logprobs_come_from_the_prefill_worker(tiny_llama, colocated, backend):
    """The prefill worker computes the prompt's log-probabilities with its KV and sends them with
    the first token; the decode worker computes nothing of the prompt, and sends them once."""
    tokens = prompt(20, seed=4)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    want = colocated.generate({"prompt_token_ids": tokens}, sp)[0].prompt_logprobs
    with Cluster(tiny_llama, backend) as c:
        lines = list(c.stream(tokens, max_tokens=3, prompt_logprobs=2))
        sent = [line["prompt_logprobs"] for line in lines if line.get("prompt_logprobs")]
        assert len(sent) == 1 and sent[0][0] is None and len(sent[0]) == len(tokens)
        assert [e[0] for e in sent[0][1:]] == tokens[1:]
        assert [e[1] for e in sent[0][1:]] == pytest.approx([e.logprob for e in want[1:]], abs=1e-4)
        assert [[t for t, _ in e[2]] for e in sent[0][1:]] == [[t for t, _ in e.top] for e in want[1:]]
        assert c.d.worker.stats().kv_landed == 1 and c.d.worker.stats().kv_recomputed == 0
        c.wait_idle()


def test_a_first_token_that_ends_its_request_lands(tiny_llama, colocated):
    """max_tokens=1: the prefill worker's token is the whole answer, and landing it finishes it."""
    prompts = [prompt(n, seed=n) for n in (9, 33)]
    with Cluster(tiny_llama, "tcp") as c:
        for logprobs in (None, 2):
            got = [c.generate(p, max_tokens=1, logprobs=logprobs)[0] for p in prompts]
            assert got == reference(colocated, prompts, max_tokens=1)
        stats = c.d.worker.stats()
        assert stats.kv_landed == 2 * len(prompts) and stats.kv_recomputed == 0 and stats.engine_failures == 0
        c.wait_idle()


@pytest.mark.parametrize("backend", ["tcp", "memory"])
def test_structured_outputs_match_colocated(tiny_llama, colocated, backend):
    """The prefill worker masks the first token, the decode worker checks it against the structure
    and masks the rest: the output is the colocated one, inside its structure."""
    from pdserve.sampling_params import Structure

    prompts = [prompt(n, seed=n) for n in (7, 30)]
    for kind, spec, sampling in (("regex", "[a-f]{2}-[0-9]{3}", dict(temperature=0)),
                                 ("choice", '["alpha", "beta", "gamma"]', dict(temperature=0.9, seed=4))):
        sp = SamplingParams(**{"max_tokens": 16, **sampling, "structure": Structure(kind, spec)})
        expected = [o.outputs[0].token_ids for o in colocated.generate([{"prompt_token_ids": p} for p in prompts], sp)]
        with Cluster(tiny_llama, backend) as c:
            got = [c.generate(p, max_tokens=16, ignore_eos=False, structure={"kind": kind, "spec": spec},
                              **sampling)[0] for p in prompts]
            assert got == expected
            assert c.d.worker.stats().kv_landed == len(prompts) and c.d.worker.stats().kv_recomputed == 0
            c.wait_idle()


def test_quantized_transfer_keeps_greedy_output(tiny_llama, colocated):
    prompts = [prompt(n, seed=i) for i, n in enumerate(LENGTHS[::2])]
    expected = reference(colocated, prompts)
    for dtype in ("int8", "fp8"):
        with Cluster(tiny_llama, "tcp", decode_worker={"kv_transfer_dtype": dtype}) as c:
            got = c.generate_many(prompts)
            agree = sum(a == b for a, b in zip(got, expected))
            assert agree >= len(prompts) - 1, f"{dtype}: {agree}/{len(prompts)} identical"
            assert c.d.worker.stats().kv_landed == len(prompts)
            c.wait_idle()


def test_small_decode_pool_preempts_instead_of_deadlocking(tiny_llama, colocated):
    # room for about three requests: reservations wait for headroom, growing decodes get preempted
    prompts = [prompt(40, seed=i) for i in range(8)]
    expected = reference(colocated, prompts, max_tokens=30)
    with Cluster(tiny_llama, "memory", decode={"kv_cache_memory": "128KiB", "decode_headroom_tokens": 16}) as c:
        assert c.generate_many(prompts, max_tokens=30) == expected
        c.wait_idle()
        stats = c.d.worker.stats()
        assert stats.kv_blocks_total == 32
        assert stats.kv_landed + stats.kv_recomputed == len(prompts)
