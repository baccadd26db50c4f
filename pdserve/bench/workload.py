"""The benchmark's sizes and its seeded prompts: ours and every baseline get the same ones."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Sizes:
    prefill_lengths: tuple[int, ...] = (512, 2048)
    decode_batches: tuple[int, ...] = (1, 8, 32, 64)
    decode_prompt_len: int = 64
    decode_steps: int = 32  # timed decode steps per repetition
    offline_requests: int = 64
    offline_prompt_range: tuple[int, int] = (16, 384)  # uniform, inclusive
    offline_new_tokens: int = 48
    hf_batch: int = 8  # transformers' static batch in the offline workload
    reps: int = 3  # timed repetitions of prefill and decode; the best counts
    offline_reps: int = 2  # the same, for the (long) offline workload
    default_decode_steps: int = 64
    matmul_size: int = 2048
    buffer_mib: int = 512
    kv_cache_memory: str = "1GiB"  # our engine's KV pool for decode and offline


FULL = Sizes()
QUICK = Sizes(prefill_lengths=(512,), decode_batches=(1, 8, 64), decode_steps=12, offline_requests=16,
              offline_new_tokens=16, reps=1, offline_reps=1, default_decode_steps=24)


@dataclass(slots=True)
class Workload:
    """Every prompt of one run, drawn once from the seed; ours and transformers get the same ones.
    Warm-ups get prompts of their own, so our prefix cache never turns a timed run into a hit."""

    prefill: dict[int, list[list[int]]]  # length -> [warm-up, rep 1, ...]
    decode: dict[int, list[list[list[int]]]]  # batch -> [warm-up batch, rep 1 batch, ...]
    offline_warmup: list[list[int]]
    offline: list[list[list[int]]]  # one set of prompts per repetition


def make_workload(sizes: Sizes, vocab_size: int, seed: int) -> Workload:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    lo, hi = sizes.offline_prompt_range
    offline = [prompt(rng.randint(lo, hi)) for _ in range(sizes.offline_requests)]
    return Workload(
        prefill={n: [prompt(n) for _ in range(1 + sizes.reps)] for n in sizes.prefill_lengths},
        decode={b: [[prompt(sizes.decode_prompt_len) for _ in range(b)] for _ in range(1 + sizes.reps)]
                for b in sizes.decode_batches},
        offline_warmup=[prompt(rng.randint(lo, hi)) for _ in range(min(8, sizes.offline_requests))],
        # Each repetition changes only the first token of every prompt: the same work, but block
        # hashes are chained, so no repetition finds the blocks of the one before in our prefix cache.
        offline=[[[(p[0] + r) % vocab_size, *p[1:]] for p in offline] for r in range(sizes.offline_reps)],
    )
