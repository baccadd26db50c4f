"""`pdserve bench-transfer`: how fast KV moves between a prefill and a decode worker, against the
raw limit measured in the same run, and what the transfer adds to time to first token.

1. Raw limits: a memcpy of the same bytes (the ceiling of `shm`) and a loopback TCP stream
   received into memory (the ceiling of `tcp` and, on a CPU host, of `nixl`).
2. Transfer only: every layer of an n-token prompt pushed through each backend's real sender and
   receiver (the workers' own classes) into leased blocks, timed from the first write to LANDED.
3. Time to first token of one long prompt: decode computing the prompt itself (colocated) against
   decode receiving it from a prefill worker (disaggregated), both in this process on the same
   cores, prefix caching off, turns taken.
4. Quantized transfer's cost: greedy agreement with the unquantized path, and the largest logit
   error of the first token computed on top of transferred KV.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.machine import environment
from pdserve.kv_transfer.base import KVLayout, Lease
from pdserve.kv_transfer.receiver import EventKind, KVReceiver
from pdserve.kv_transfer.shm import SharedKVPool, ShmSender
from pdserve.kv_transfer.tcp import TcpSender
from pdserve.models.arch_config import ArchConfig
from pdserve.models.loader import load_checkpoint


def _log(message: str) -> None:
    print(f"[bench-transfer] {message}", file=sys.stderr, flush=True)


def _best(fn, reps: int) -> float:
    fn()
    return min(_timed(fn) for _ in range(reps))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- 1. raw limits ----------------------------------------------------------------------------

def memcpy_gbs(num_bytes: int, reps: int = 5) -> float:
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return num_bytes / _best(lambda: dst.copy_(src), reps) / 1e9


def loopback_gbs(num_bytes: int, reps: int = 3, chunk: int = 1 << 20) -> float:
    """A TCP stream over 127.0.0.1, sent from a thread and received into one buffer with recv_into."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname()[:2])
    conn, _ = server.accept()
    payload = memoryview(bytearray(chunk))
    sink = memoryview(bytearray(num_bytes))

    def send() -> None:
        left = num_bytes
        while left:
            n = min(chunk, left)
            client.sendall(payload[:n])
            left -= n

    def once() -> None:
        t = threading.Thread(target=send)
        t.start()
        got = 0
        while got < num_bytes:
            got += conn.recv_into(sink[got:])
        t.join()

    try:
        return num_bytes / _best(once, reps) / 1e9
    finally:
        for s in (client, conn, server):
            s.close()


# -- 2. transfer only ---------------------------------------------------------------------------

def transfer_gbs(cfg: ArchConfig, dtype: torch.dtype, backend: str, num_tokens: int, encoding: str = "raw",
                 reps: int = 3) -> dict[str, float]:
    """Push every layer of `num_tokens` through `backend` into leased blocks; best of `reps`."""
    layout = KVLayout.of(cfg, dtype)
    block = 16
    slots = -(-num_tokens // block) * block
    shape = (cfg.num_layers, slots, 2, cfg.num_kv_heads, cfg.head_dim)
    src = torch.randn(shape).to(dtype)
    pool = SharedKVPool(shape, dtype) if backend == "shm" else None
    dst = pool.tensor if pool is not None else torch.zeros(shape, dtype=dtype)
    events: queue.Queue = queue.Queue()
    rx = KVReceiver(layout, dst, events)
    peer: dict[str, Any] = {"host": rx.address[0], "port": rx.address[1]}
    if backend == "shm":
        peer.update(path=pool.path, num_slots=slots)
    if backend == "nixl":
        from pdserve.kv_transfer.nixl import NixlSender, local_agent
        peer.update(local_agent(dst).offer())
        sender_type = NixlSender
    else:
        sender_type = {"tcp": TcpSender, "shm": ShmSender}[backend]
    sender = sender_type(layout, src, peer, encoding=encoding)
    table = list(range(slots // block))
    runs = [(0, num_tokens)]
    fences = iter(range(1, 1 << 30))

    def once() -> None:
        lease = Lease("bench", next(fences), table, block, 0, num_tokens, time.monotonic() + 600)
        rx.open_lease(lease)
        sender.prepare(lease)  # as a prefill worker does on accepting a lease, while it computes
        sender.flush()
        for layer in range(cfg.num_layers):
            sender.write(lease, layer, 0, num_tokens, runs)
        sender.notify(lease, 0)
        while True:
            try:
                event = events.get(timeout=1.0)
                break
            except queue.Empty:
                if not sender.alive:
                    raise RuntimeError(f"the {backend} link failed during the transfer") from None
        assert event.kind == EventKind.LANDED, event
        sender.forget(lease)

    try:
        seconds = _best(once, reps)
        if encoding == "raw":
            assert torch.equal(dst[:, :num_tokens], src[:, :num_tokens]), f"{backend}: KV arrived changed"
    finally:
        sender.close()
        rx.close()
        if backend == "nixl":
            from pdserve.kv_transfer.nixl import release_agent
            release_agent(src)
            release_agent(dst)
        if pool is not None:
            pool.close()
    kv_bytes = num_tokens * layout.slot_bytes * cfg.num_layers
    return {"seconds": seconds, "kv_gbs": kv_bytes / seconds / 1e9, "kv_bytes": kv_bytes}


# -- 3. time to first token ---------------------------------------------------------------------

class _Pair:
    """A prefill and a decode worker in this process, behind their HTTP endpoints."""

    def __init__(self, model: str, dtype: str, backend: str, kv_transfer_dtype: str = "auto", **engine: Any) -> None:
        from pdserve.config import EngineConfig
        from pdserve.worker.server import ServerThread, create_app
        from pdserve.worker.worker import Worker

        def worker(role: str, **extra: Any) -> tuple[Worker, ServerThread]:
            cfg = EngineConfig(model=model, role=role, dtype=dtype, enable_prefix_caching=False, **engine)
            w = Worker(cfg, [backend], **extra)
            w.start()
            return w, ServerThread(create_app(w)).start()

        self.p, self.p_http = worker("prefill")
        self.d, self.d_http = worker("decode", kv_transfer_dtype=kv_transfer_dtype)

    def first_token(self, tokens: list[int], disaggregated: bool, max_tokens: int = 1) -> tuple[float, list[int]]:
        """(seconds to the first streamed token, all tokens) for one request to the decode worker."""
        import httpx

        body = {"prompt_token_ids": tokens, "sampling": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True},
                "prefill_url": self.p_http.url if disaggregated else None}
        t0 = time.perf_counter()
        ttft = None
        out: list[int] = []
        with httpx.stream("POST", self.d_http.url + "/v1/generate", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if ttft is None:
                    ttft = time.perf_counter() - t0
                out += json.loads(line)["outputs"][0]["token_ids"]
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
        sent = pair.p.stats()["kv_bytes_sent"]
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
        logits, rows = forward(step, on_layer)
        if logits is not None:
            captured.append(logits.clone())
        return logits, rows
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


# -- the command ------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.kv_transfer.nixl import nixl_available
    from pdserve.models.registry import resolve_model

    model = resolve_model(args.model)
    cfg = ArchConfig.from_hf_config(load_checkpoint(model).hf_config)
    dtype = getattr(torch, args.dtype)
    backends = [b for b in args.backends.split(",") if b != "nixl" or nixl_available()]
    layout = KVLayout.of(cfg, dtype)
    result: dict[str, Any] = {"model": args.model or "default", "dtype": args.dtype, "environment": environment(),
                              "threads": torch.get_num_threads(), "kv_bytes_per_token": layout.slot_bytes * cfg.num_layers}
    rows = []
    for n in args.sizes:
        num_bytes = n * layout.slot_bytes * cfg.num_layers
        _log(f"raw limits for {n} tokens ({num_bytes / 1e6:.0f} MB of KV)")
        raw = {"memcpy": memcpy_gbs(num_bytes), "loopback": loopback_gbs(num_bytes)}
        for backend in backends:
            for encoding in ["raw"] + (["int8"] if backend == "tcp" and args.quantized else []):
                _log(f"{backend} ({encoding}), {n} tokens")
                t = transfer_gbs(cfg, dtype, backend, n, encoding, reps=args.reps)
                limit_name = "memcpy" if backend == "shm" else "loopback"
                rows.append({"backend": backend, "encoding": encoding, "tokens": n, **t, "raw_limit": limit_name,
                             "raw_gbs": raw[limit_name], "fraction_of_raw": t["kv_gbs"] / raw[limit_name]})
                _log(f"  {t['kv_gbs']:.2f} GB/s of KV = {t['kv_gbs'] / raw[limit_name]:.0%} of {limit_name} "
                     f"({raw[limit_name]:.2f} GB/s)")
    result["transfer"] = rows
    result["ttft"] = []
    for backend in backends:
        _log(f"time to first token, {args.ttft_tokens}-token prompt, {backend}")
        r = ttft_comparison(model, args.dtype, backend, args.ttft_tokens, args.reps, cfg.vocab_size)
        _log(f"  colocated {r['colocated_ttft_s'] * 1e3:.0f} ms, disaggregated {r['disaggregated_ttft_s'] * 1e3:.0f} ms "
             f"(+{r['added_fraction']:.1%})")
        result["ttft"].append(r)
    if args.quantized:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, cfg.vocab_size, (int(n),), generator=g).tolist() for n in torch.randint(33, 400, (8,), generator=g)]
        result["quantized"] = []
        for encoding in ("int8", "fp8"):
            _log(f"accuracy of {encoding} transfer")
            agree = greedy_agreement(model, args.dtype, encoding, prompts, args.quant_tokens)
            err = logit_error(model, args.dtype, encoding, prompts)
            result["quantized"].append({**agree, **err})
            _log(f"  {agree['identical']}/{len(prompts)} greedy outputs identical, max logit error {err['max_abs_logit_error']:.4f}")
    return result


def markdown(result: dict[str, Any]) -> str:
    lines = [f"model {result['model']} ({result['dtype']}), {result['kv_bytes_per_token'] / 1e3:.1f} kB of KV per token, "
             f"{result['threads']} threads", "",
             "| backend | tokens | KV GB/s | raw limit | share of raw |", "| --- | --- | --- | --- | --- |"]
    for r in result["transfer"]:
        name = r["backend"] + (f" ({r['encoding']})" if r["encoding"] != "raw" else "")
        lines.append(f"| {name} | {r['tokens']} | {r['kv_gbs']:.2f} | {r['raw_limit']} {r['raw_gbs']:.2f} | "
                     f"{r['fraction_of_raw']:.0%} |")
    lines += ["", "| backend | prompt | colocated TTFT | disaggregated TTFT | added |", "| --- | --- | --- | --- | --- |"]
    for r in result["ttft"]:
        lines.append(f"| {r['backend']} | {r['prompt_tokens']} | {r['colocated_ttft_s'] * 1e3:.0f} ms | "
                     f"{r['disaggregated_ttft_s'] * 1e3:.0f} ms | {r['added_fraction']:+.1%} |")
    if result.get("quantized"):
        lines += ["", "| transfer dtype | greedy outputs identical | max logit error | first-token flips |",
                  "| --- | --- | --- | --- |"]
        for r in result["quantized"]:
            lines.append(f"| {r['encoding']} | {r['identical']}/{r['prompts']} ({r['new_tokens']} tokens) | "
                         f"{r['max_abs_logit_error']:.4f} | {r['first_token_flips']}/{r['prompts']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench-transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--sizes", default="1024,8000", help="prompt lengths for the transfer-only runs")
    p.add_argument("--ttft-tokens", type=int, default=2048)
    p.add_argument("--backends", default="tcp,shm,nixl")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-quantized", dest="quantized", action="store_false", help="skip the int8/fp8 runs")
    p.add_argument("--quant-tokens", type=int, default=32, help="tokens generated per prompt for greedy agreement")
    p.add_argument("--quick", action="store_true", help="small sizes, one rep: a smoke run of every part")
    p.add_argument("--out", default="results/bench_transfer.json")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.ttft_tokens, args.reps, args.quant_tokens = "256", 256, 1, 8
    args.sizes = [int(s) for s in str(args.sizes).split(",")]
    result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(markdown(result))
    _log(f"wrote {out}")
    if "nixl" in args.backends:
        # NIXL's UCX threads sometimes abort the interpreter's own exit (std::terminate) after
        # many agents came and went; every result is written, so leave without finalizers.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
