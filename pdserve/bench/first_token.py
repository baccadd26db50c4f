"""Parts 3 and 4 of `pdserve bench-transfer`: what disaggregation adds to time to first token,
and what quantized transfer costs in accuracy, measured through real workers in this process.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from pdserve import wire
from pdserve.kv_transfer.base import KVLayout


# -- 3. time to first token ---------------------------------------------------------------------

class _Pair:
    """A prefill and a decode worker in this process, behind their HTTP endpoints."""

    def __init__(self, model: str, dtype: str, backend: str, kv_transfer_dtype: str = "auto", **engine: Any) -> None:
        from pdserve.config import EngineConfig
        from pdserve.worker.server import ServerThread, create_app
        from pdserve.worker.config import WorkerConfig
        from pdserve.worker.worker import Worker

        def worker(role: str, **extra: Any) -> tuple[Worker, ServerThread]:
            cfg = EngineConfig(model=model, role=role, dtype=dtype, enable_prefix_caching=False, **engine)
            w = Worker(cfg, WorkerConfig(transfer=backend, **extra))
            w.start()
            return w, ServerThread(create_app(w)).start()

        self.p, self.p_http = worker("prefill")
        self.d, self.d_http = worker("decode", kv_transfer_dtype=kv_transfer_dtype)

    def first_token(self, tokens: list[int], disaggregated: bool, max_tokens: int = 1) -> tuple[float, list[int]]:
        """(seconds to the first streamed token, all tokens) for one request to the decode worker."""
        import httpx

        body = wire.GenerateRequest(prompt_token_ids=tokens, prefill_url=self.p_http.url if disaggregated else None,
                                    sampling=wire.Sampling(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        t0 = time.perf_counter()
        ttft = None
        out: list[int] = []
        with httpx.stream("POST", self.d_http.url + "/v1/generate", content=wire.encode(body), timeout=600) as r:
            for line in r.iter_lines():
                if not line.strip():
                    continue  # a keep-alive
                if ttft is None:
                    ttft = time.perf_counter() - t0
                out += wire.decode(line, wire.OutputLine).outputs[0].token_ids
        return ttft, out

    def close(self) -> None:
        for http, w in ((self.p_http, self.p), (self.d_http, self.d)):
            http.stop()
            w.stop()


def ttft_comparison(model: str, dtype: str, backend: str, prompt_len: int, reps: int, vocab: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(prompt_len)
    pair = _Pair(model, dtype, backend, kv_cache_memory="1GiB", max_num_batched_tokens=512)
    try:
        pair.first_token(torch.randint(1, vocab, (64,), generator=g).tolist(), True)  # warm up both paths
        pair.first_token(torch.randint(1, vocab, (64,), generator=g).tolist(), False)
        colocated, disaggregated = [], []
        for rep in range(reps):
            for disagg, sink in ((False, colocated), (True, disaggregated))[:: 1 if rep % 2 == 0 else -1]:
                sink.append(pair.first_token(torch.randint(1, vocab, (prompt_len,), generator=g).tolist(), disagg)[0])
        sent = pair.p.stats().kv_bytes_sent
        decode = pair.d.stats()
        if decode.kv_recomputed or decode.kv_landed != reps + 1:
            raise RuntimeError(f"{backend}: the disaggregated runs did not all take their KV from prefill: {decode}")
    finally:
        pair.close()
    c, d = statistics.median(colocated), statistics.median(disaggregated)
    return {"backend": backend, "prompt_tokens": prompt_len, "colocated_ttft_s": c, "disaggregated_ttft_s": d,
            "added_s": d - c, "added_fraction": (d - c) / c, "colocated_all_s": colocated,
            "disaggregated_all_s": disaggregated, "kv_bytes_sent": sent}


# -- 4. quantized transfer's accuracy -----------------------------------------------------------

def greedy_agreement(model: str, dtype: str, encoding: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    pair = _Pair(model, dtype, "tcp", kv_transfer_dtype=encoding, kv_cache_memory="512MiB")
    try:
        same = 0
        first_diffs = []
        for tokens in prompts:
            ref = pair.first_token(tokens, False, new_tokens)[1]
            got = pair.first_token(tokens, True, new_tokens)[1]
            same += ref == got
            first_diffs.append(next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), new_tokens))
    finally:
        pair.close()
    return {"encoding": encoding, "prompts": len(prompts), "new_tokens": new_tokens, "identical": same,
            "mean_tokens_before_first_difference": statistics.mean(first_diffs)}


def logit_error(model: str, dtype: str, encoding: str, prompts: list[list[int]]) -> dict[str, float]:
    """Largest |logit| difference of the first generated token when the prompt's KV went through
    `encoding` (quantized, then restored), against the same KV unquantized."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.config import EngineConfig
    from pdserve.kv_transfer.quant import dequantize_into, quantize
    from pdserve.sampling_params import SamplingParams

    block = 16
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, block_size=block, kv_cache_memory="512MiB"))
    captured: list[torch.Tensor] = []
    forward = engine.runner.forward

    def capture(step, on_layer=None):
        logits, heads = forward(step, on_layer)
        if logits is not None:
            captured.append(logits.clone())
        return logits, heads
    engine.runner.forward = capture

    def last_logits(tokens: list[int]) -> torch.Tensor:
        captured.clear()
        engine.add_request(None, {"prompt_token_ids": tokens}, SamplingParams(temperature=0, max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        return captured[-1][0]

    worst, flips = 0.0, 0
    layout = KVLayout.of(engine.model_config, engine.dtype)
    kv = engine.runner.kv_cache
    for tokens in prompts:
        tokens = tokens[: (len(tokens) - 1) // block * block + 1]  # whole blocks, then one token
        engine.block_manager.reset_prefix_cache()
        last_logits(tokens[:-1])  # the prompt's KV, cached in whole blocks
        exact = last_logits(tokens)  # the last token on top of it
        runs = [(0, kv.shape[1])]
        for layer in range(kv.shape[0]):  # every slot through the wire encoding and back
            payload = torch.frombuffer(bytearray(quantize(kv[layer], encoding)), dtype=torch.uint8)
            dequantize_into(kv, layer, runs, payload, layout, encoding)
        approx = last_logits(tokens)
        worst = max(worst, (approx - exact).abs().max().item())
        flips += int(approx.argmax() != exact.argmax())
    return {"encoding": encoding, "max_abs_logit_error": worst, "first_token_flips": flips, "prompts": len(prompts)}
