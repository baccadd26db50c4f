"""Builders shared by the tests: requests, schedulers, tiny models, engines, leak checks."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler
from pdserve.models.synthetic import write_model

_ids = itertools.count()

# One tiny checkpoint per architecture, each exercising that family's distinctive features.
TINY_VARIANTS: dict[str, dict[str, Any]] = {
    # GQA, untied embeddings, Llama-3 rope scaling (short original length so it matters here)
    "llama": dict(architecture="llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    # MQA: a single KV head
    "mistral": dict(architecture="mistral", num_key_value_heads=1),
    # q/k/v biases, tied embeddings
    "qwen2": dict(architecture="qwen2"),
    # q/k RMSNorm, explicit head_dim (heads * head_dim != hidden)
    "qwen3": dict(architecture="qwen3", head_dim=32),
    # Gemma 3: two periods of two local layers (a window of 8: shorter than the prompts, a block and
    # a half past a block edge) and a global one, rotated by bases of their own (the global layers'
    # linearly scaled), a query scale other than head_dim's, one KV head
    "gemma3": dict(architecture="gemma3", num_hidden_layers=6, num_key_value_heads=1, head_dim=32,
                   sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                   query_pre_attn_scalar=24, rope_theta=1_000_000.0, rope_local_base_freq=100.0,
                   rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # routed experts (top 2 of 4, renormalized), GQA
    "mixtral": dict(architecture="mixtral"),
    # q/k/v biases, a dense first layer, a shared expert with its gate, top-k weights as the router gives them
    "qwen2_moe": dict(architecture="qwen2_moe"),
    # q/k RMSNorm, top 2 of 8 renormalized
    "qwen3_moe": dict(architecture="qwen3_moe"),
}


def make_tiny_model(directory: Path, variant: str = "llama", seed: int = 0, layout: str = "installed") -> Path:
    """A tiny checkpoint. `layout` is how its config.json is written: "installed" as the installed
    transformers saves it (so a field the next release moves fails our tests first), "legacy" as
    `write_model` writes it (transformers 4: top-level `rope_theta` / `rope_scaling`)."""
    if layout not in ("installed", "legacy"):
        raise ValueError(f"unknown config layout {layout!r}")
    spec = dict(TINY_VARIANTS[variant])
    arch = spec.pop("architecture")
    path = write_model(directory, "tiny", arch, seed=seed, **spec)
    if layout == "installed":
        resave_config_with_transformers(path)
    return path


def make_base_model(directory: Path) -> Path:
    """The tiny llama as base models ship: its tokenizer has no chat template."""
    path = make_tiny_model(directory, "llama")
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["chat_template"]
    config_file.write_text(json.dumps(config, indent=2))
    return path


def resave_config_with_transformers(model_dir: Path) -> None:
    from transformers import AutoConfig  # slow to import; the model-free tests never need it

    AutoConfig.from_pretrained(model_dir).save_pretrained(model_dir)


def make_llm(model_dir: Path, **engine_args: Any) -> LLM:
    args = dict(dtype="float32", kv_cache_memory="8MiB", block_size=4, max_num_batched_tokens=256)
    args.update(engine_args)
    return LLM(str(model_dir), **args)


def every_draft_verified(engine) -> Any:
    """Leaves an engine's draft budget without step timings, so that it verifies every draft:
    acceptance counts then depend on the tokens alone, not on this machine's timing (the budget's
    own decisions are tested in tests/engine/test_draft_budget.py). Returns the engine."""
    engine.scheduler.observe_step = lambda rows, seconds: None
    return engine


def make_speculating_llm(model_dir: Path, **engine_args: Any) -> LLM:
    """`make_llm` with speculative decoding (ngram unless `speculative` says otherwise), every
    draft verified (`every_draft_verified`)."""
    llm = make_llm(model_dir, **{"speculative": "ngram", **engine_args})
    every_draft_verified(llm.engine)
    return llm


def engine_config(model_dir: Path, role: str, **overrides: Any) -> EngineConfig:
    """A worker's engine: the tiny model's defaults, prefill in chunks of 32 tokens."""
    args = dict(dtype="float32", kv_cache_memory="8MiB", block_size=4, max_num_batched_tokens=32)
    args.update(overrides)
    return EngineConfig(model=str(model_dir), role=role, **args)


def offline_text(llm: LLM, prompt: str, max_tokens: int, **sampling: Any) -> str:
    """The text an engine in this process gives (greedy unless `sampling` says otherwise): what a
    served request must match."""
    sp = SamplingParams(**{"temperature": 0, "max_tokens": max_tokens, **sampling})
    return llm.generate(prompt, sp)[0].outputs[0].text


def make_request(
    num_prompt_tokens: int = 8,
    prompt: list[int] | None = None,
    max_tokens: int = 4,
    priority: int = 0,
    request_id: str | None = None,
    arrival_time: float | None = None,
    **params: Any,
) -> Request:
    tokens = prompt if prompt is not None else [(i * 7 + 3) % 97 + 1 for i in range(num_prompt_tokens)]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    rid = request_id or f"r{next(_ids)}"
    return Request(rid, tokens, sp, len(tokens) + max_tokens, priority,
                   arrival_time=arrival_time if arrival_time is not None else float(next(_ids)))


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    enable_prefix_caching: bool = True,
    shortest_first_max_wait_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Scheduler:
    blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(blocks, max_num_batched_tokens, max_num_seqs,
                     shortest_first_max_wait_s=shortest_first_max_wait_s, clock=clock)


def run_fake_step(scheduler: Scheduler, token: int = 5) -> list[Request]:
    """One step without a model: every request whose chunk ends its tokens 'samples' `token`."""
    out = scheduler.schedule()
    sampled = [
        token if r.num_computed_tokens + n == r.num_tokens else None
        for r, n in zip(out.requests, out.num_new_tokens)
    ]
    return scheduler.update(out, sampled)


def assert_no_leaks(blocks: BlockManager) -> None:
    assert blocks.num_free_blocks == blocks.num_blocks, (
        f"{blocks.num_blocks - blocks.num_free_blocks} KV blocks leaked"
    )
    assert all(b.ref_count == 0 for b in blocks.blocks)


def assert_engine_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.scheduler.has_unfinished()
    assert not engine.has_unfinished_requests()
    assert_no_leaks(engine.block_manager)


def paged_logits(llm: LLM, prompt: list[int], num_decode_steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """Logits at the prompt's last position and after each greedy decode step."""
    engine = llm.engine
    sched, runner = engine.scheduler, engine.runner
    req = Request("parity", prompt, SamplingParams(temperature=0, max_tokens=num_decode_steps + 1,
                                                   ignore_eos=True), len(prompt) + num_decode_steps + 1)
    sched.add(req)
    rows = []
    while sched.has_unfinished():
        step = sched.schedule()
        logits, heads = runner.forward(step)
        sampled = [None] * len(step.requests)
        if logits is not None:
            rows.append(logits[0])
            sampled[heads[0][0]] = int(logits[0].argmax())
        sched.update(step, sampled)
    assert_no_leaks(engine.block_manager)
    return rows, req.output_token_ids


class FailingSampler:
    """Samples as usual (drawing every seeded request's noise), then raises when a request whose id
    starts with `bad` is in the batch: one request that breaks its step."""

    def __init__(self, sample, bad: str) -> None:
        self.sample, self.bad = sample, bad

    def __call__(self, logits, positions):
        tokens = self.sample(logits, positions)
        if any(r.request_id.startswith(self.bad) for r, _ in positions):
            raise RuntimeError("this request breaks the sampler")
        return tokens


def kernel_isa_params() -> list:
    """pytest params, one per variant of pdserve's CPU kernels; those this CPU cannot run (or all,
    where the kernels do not build) skipped with the reason."""
    import pytest

    from pdserve.layers.kernels import native

    kernels = native.load()
    if kernels is None:
        return [pytest.param(None, marks=pytest.mark.skip(reason="pdserve's CPU kernels do not build here"))]
    return [pytest.param(name, marks=() if name in kernels.supported else pytest.mark.skip(
        reason=f"this CPU lacks the instructions of the {name} kernels")) for name in native.ISA_NAMES]
