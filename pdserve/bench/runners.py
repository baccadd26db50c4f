"""Timed runs of one workload on our engine, transformers and llama.cpp; each returns seconds."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from pdserve import LLM, SamplingParams
from pdserve.config import resolve_dtype


def torch_dtype(name: str) -> torch.dtype:
    return resolve_dtype(name, torch.device("cpu"))


# -- our engine --------------------------------------------------------------------------------


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def ours_prefill(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], _greedy(1))
    return time.perf_counter() - start


def ours_decode(llm: LLM, prompts: list[list[int]], steps: int) -> float:
    """Seconds of `steps` engine steps once every request holds its first token."""
    engine = llm.engine
    # Room for the tokens early requests decode while later ones still prefill: none may finish
    # inside the timed window, so every timed step runs the whole batch.
    params = _greedy(steps + len(prompts) + 2)
    ids = [engine.add_request(None, {"prompt_token_ids": p}, params) for p in prompts]
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(out.request_id for out in engine.step())
    tokens = 0
    start = time.perf_counter()
    for _ in range(steps):
        tokens += len(engine.step())  # one output per request that got a token
    seconds = time.perf_counter() - start
    for request_id in ids:
        engine.abort(request_id)
    engine.step()  # hands back the aborted requests; their blocks are already free
    if tokens != steps * len(prompts):  # then it timed preemption and recompute, not decode
        raise RuntimeError(f"batch {len(prompts)} does not fit the KV cache; raise kv_cache_memory")
    return seconds


def ours_offline(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(new_tokens))
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    assert all(o.num_cached_tokens == 0 for o in outs), "a prefix-cache hit: less work than transformers does"
    return seconds


# -- transformers ------------------------------------------------------------------------------


class _PrefillClock:
    """A logits processor that notes when generate() first calls it: right after the prefill."""

    def __init__(self) -> None:
        self.time: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.time is None:
            self.time = time.perf_counter()
        return scores


def load_transformers(path: Path, dtype: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generation-config chatter on every call
    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype)).eval()


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """One static batch, left-padded, greedy: (total seconds, seconds after the prefill)."""
    from transformers import LogitsProcessorList

    pad = model.config.pad_token_id or 0
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    clock = _PrefillClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens,  # min: no early stop on eos
            logits_processor=LogitsProcessorList([clock]),
        )
    end = time.perf_counter()
    assert out.shape == (len(prompts), width + new_tokens)
    return end - start, end - clock.time


# -- llama.cpp ---------------------------------------------------------------------------------


def llamacpp_decoder(path: Path, n_ctx: int, steps: int) -> Callable[[list[list[int]]], float]:
    """Greedy decode through llama-cpp-python of a batch of one: seconds from its first token to the
    `steps`-th after it, as for our engine."""
    from llama_cpp import Llama

    threads = torch.get_num_threads()
    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)

    def decode(batch: list[list[int]]) -> float:
        stamps = []
        gen = llm.generate(batch[0], top_k=1, temp=0.0)  # generate never stops at eos; its callers do
        for _ in gen:
            stamps.append(time.perf_counter())
            if len(stamps) == steps + 1:
                break
        gen.close()
        return stamps[-1] - stamps[0]

    return decode
