"""Prefill and decode workers of different tensor-parallel sizes exchange KV directly: the sender
writes the decode worker's split of the heads, so prefill TP 2 -> decode TP 1, TP 1 -> TP 2 and
TP 2 -> TP 2 all equal colocated TP 1, token for token, over every backend; no blocks leak."""

from __future__ import annotations

import pytest
import torch

from pdserve import SamplingParams
from tests.factories import make_llm
from tests.worker.cluster import CASES_WITH_MEMORY, Cluster, prompt

LENGTHS = [5, 17, 33, 64, 90]


@pytest.fixture(scope="module")
def colocated(tiny_llama):
    return make_llm(tiny_llama, block_size=4)


@pytest.mark.parametrize("prefill_ranks,decode_ranks", [(2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("backend", CASES_WITH_MEMORY)
def test_any_split_pair_matches_colocated(tiny_llama, colocated, backend, prefill_ranks, decode_ranks):
    if backend == "nixl" and prefill_ranks != decode_ranks:
        pytest.skip("NIXL copies raw slot ranges: it serves pairs of equal splits only")
    prompts = [prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in colocated.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    with Cluster(tiny_llama, backend, prefill=dict(tensor_parallel_size=prefill_ranks),
                 decode=dict(tensor_parallel_size=decode_ranks)) as c:
        assert c.generate_many(prompts) == expected
        c.wait_idle()
        stats = c.d.worker.stats()
        assert stats.kv_landed == len(prompts) and stats.kv_recomputed == 0
        assert c.d.worker.layout.ranks == decode_ranks and c.p.worker.layout.ranks == prefill_ranks


def test_a_split_pool_holds_every_heads_kv(tiny_llama):
    """A worker of two ranks holds, block for block, what one process holds, its heads split: rank r's
    share of layer i is pool layer 2i + r."""
    p = prompt(40)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    one = make_llm(tiny_llama, block_size=4)
    one.generate({"prompt_token_ids": p}, sp)
    with make_llm(tiny_llama, block_size=4, tensor_parallel_size=2) as two:
        two.generate({"prompt_token_ids": p}, sp)
        whole = one.engine.runner.kv_cache  # [layers, slots, 2, heads, head_dim]
        split = two.engine.runner.kv_cache  # [layers * 2, slots, 2, heads / 2, head_dim]
        layers, slots, _, heads, dim = whole.shape
        joined = split.view(layers, 2, slots, 2, heads // 2, dim).permute(0, 2, 3, 1, 4, 5).reshape(whole.shape)
        used = slice(0, 40)  # the prompt's first 40 slots: blocks 0..9 of both pools
        torch.testing.assert_close(joined[:, used], whole[:, used])
