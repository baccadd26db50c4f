"""Tensor parallelism inside one engine: ranks as processes, token for token equal to one process
in float32 for every architecture (dense, tied, biased, q/k-normed, routed experts split or whole),
with batching, chunked prefill, the prefix cache, log-probabilities and seeded sampling; its ranks
stopped with it; a lost rank reported, not waited on forever; splits the model cannot take refused.
(Workers of different splits exchanging KV: tests/worker/test_tensor_parallel_pairs.py.)"""

import os
import signal
import time

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.parallel.lost import RanksLost
from pdserve.models.loader import build_model, load_checkpoint
from pdserve.models.shard import Shard
from tests.factories import assert_engine_idle, make_llm

SHARED = "the model token prefill decode cache block batch request latency " * 3
PROMPTS = [SHARED + "one", SHARED + "two three", "a", "def return class import self print for while if else"]


def run(llm: LLM) -> list[tuple]:
    """Greedy and seeded outputs, with sampled and prompt log-probabilities (each a head product the
    ranks gather)."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy) + llm.generate(PROMPTS[:2], seeded)
    return [(o.outputs[0].token_ids, o.num_cached_tokens,
             [round(e.logprob, 4) for e in o.outputs[0].logprobs or []],
             [None if e is None else round(e.logprob, 4) for e in o.prompt_logprobs or []]) for o in outs]


@pytest.mark.parametrize("variant,expert_parallel", [
    ("llama", False), ("qwen2", False), ("qwen3", False), ("mixtral", False), ("qwen2_moe", True),
    ("qwen3_moe", False), ("qwen3_moe", True)])
def test_two_ranks_equal_one(tiny_models, variant, expert_parallel):
    args = dict(max_num_batched_tokens=16)  # prompts in chunks; the shared prefix from the cache
    expected = run(make_llm(tiny_models[variant], **args))
    with make_llm(tiny_models[variant], tensor_parallel_size=2, expert_parallel=expert_parallel, **args) as llm:
        got = run(llm)
        assert got[0][0] == expected[0][0] and len(got) == len(expected)
        assert got[-1][1] > 0  # the prompt came back: its prefix from the ranks' caches
        for (tokens, cached, logprobs, prompt), (want_tokens, want_cached, want_logprobs, want_prompt) in zip(
                got, expected):
            assert (tokens, cached) == (want_tokens, want_cached)
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=2e-4, rtol=0)
            assert len(prompt) == len(want_prompt)
        assert_engine_idle(llm)
        procs, directory = llm.engine.ranks.procs, llm.engine.ranks.dir
    assert all(p.poll() is not None for p in procs) and not directory.exists()


def test_shards_add_up_to_the_whole_layer(tiny_models):
    """Without processes: each rank's partial attention and MLP outputs add to the whole model's."""
    ckpt = load_checkpoint(tiny_models["qwen2_moe"])
    cpu = torch.device("cpu")
    whole = build_model(ckpt, torch.float32, cpu, "none", pack_weights=False)
    for expert_parallel in (False, True):
        parts = [build_model(ckpt, torch.float32, cpu, "none", pack_weights=False,
                             shard=Shard(r, 2, expert_parallel)) for r in range(2)]
        x = torch.randn(5, whole.cfg.hidden_size)
        for layer in (0, 1):  # dense, then routed with a shared expert
            torch.testing.assert_close(sum(p.layers[layer].mlp(x) for p in parts), whole.layers[layer].mlp(x))
        assert parts[1].lm_head.shape[0] == whole.lm_head.shape[0] // 2
        assert parts[0].layers[0].self_attn.num_kv_heads == whole.cfg.num_kv_heads // 2


def test_a_lost_rank_fails_the_step_instead_of_hanging(tiny_models):
    llm = make_llm(tiny_models["llama"], tensor_parallel_size=2)
    follower = llm.engine.ranks.procs[0]
    os.kill(follower.pid, signal.SIGKILL)
    follower.wait()
    started = time.monotonic()
    with pytest.raises(RanksLost):
        llm.generate("the model", SamplingParams(max_tokens=4))
    assert time.monotonic() - started < 60
    llm.close()


@pytest.mark.parametrize("args,message", [
    (dict(tensor_parallel_size=3), "does not divide the model's num_key_value_heads"),
    (dict(tensor_parallel_size=2, compile_decode=True), "cannot yet be combined with compile_decode"),
    (dict(tensor_parallel_size=2, speculative="draft:/nowhere"), "speculative draft head or model"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be 1 to"),
])
def test_splits_it_cannot_run_are_refused(tiny_models, args, message):
    with pytest.raises(ValueError, match=message):
        make_llm(tiny_models["llama"], **args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_memory_sums_are_the_same_bits_on_every_rank(tmp_path, dtype):
    """Three ranks (threads here, each with its own mapping of the file) add partial sums of
    several shapes, twice over each slot set, between broadcasts and gathers as a step makes them:
    every rank gets the sum, bit for bit the same, rank 0's broadcast and every part gathered."""
    import threading

    from pdserve.engine.parallel.shm_reduce import ShmChannel

    size, hidden = 3, 48
    reducers = [ShmChannel(str(tmp_path / "channel"), r, size, hidden, max_rows=8) for r in range(size)]
    g = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(size)] for rows in (1, 8, 3, 5)]
    got: dict[int, list[torch.Tensor]] = {r: [] for r in range(size)}
    told: dict[int, list[list[int]]] = {r: [] for r in range(size)}
    gathered: dict[int, list[torch.Tensor]] = {r: [] for r in range(size)}

    def rank(r: int) -> None:
        for i, parts in enumerate(inputs):
            plan = torch.tensor([i, 7, 11] if r == 0 else [0, 0, 0])
            told[r].append(reducers[r].broadcast(plan).tolist())
            got[r].append(reducers[r].all_reduce(parts[r].clone()))
            gathered[r].append(torch.cat(reducers[r].all_gather(torch.full((2, 3), float(r)))))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i, parts in enumerate(inputs):
        expected = parts[0] + parts[1] + parts[2]
        for r in range(size):
            assert torch.equal(got[r][i], got[0][i]) and told[r][i] == [i, 7, 11]
            assert gathered[r][i].tolist() == [[float(k)] * 3 for k in range(size) for _ in range(2)]
        torch.testing.assert_close(got[0][i], expected)
    assert reducers[0].fits(torch.zeros(8, hidden)) and not reducers[0].fits(torch.zeros(9, hidden))
    assert not reducers[0].fits(torch.zeros(hidden, 8).t())  # not contiguous


def test_a_shared_memory_sum_whose_peer_died_raises(tmp_path):
    import subprocess
    import sys

    from pdserve.engine.parallel.shm_reduce import ShmChannel

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    mine = ShmChannel(str(tmp_path / "channel"), 0, 2, 16, max_rows=4)
    mine._pids[1] = gone.pid  # as the peer wrote it, before it died
    with pytest.raises(RanksLost, match="rank 1"):
        mine.all_reduce(torch.ones(1, 16))


def test_a_killed_workers_directory_is_reaped_by_the_next(tmp_path):
    import subprocess
    import sys

    from pdserve.engine.parallel.ranks import reap_stale

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / f"pdserve-tp-{gone.pid}-abc").mkdir()
    (tmp_path / f"pdserve-tp-{gone.pid}-abc" / "kv").write_bytes(b"x")
    (tmp_path / f"pdserve-tp-{os.getpid()}-def").mkdir()  # a live worker's
    (tmp_path / "pdserve-tp-unnamed").mkdir()
    assert reap_stale(str(tmp_path)) == [f"pdserve-tp-{gone.pid}-abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"pdserve-tp-{os.getpid()}-def", "pdserve-tp-unnamed"]
