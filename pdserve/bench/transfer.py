"""`pdserve bench-transfer`: how fast KV moves between a prefill and a decode worker, against the
raw limit measured in the same run, and what the transfer adds to time to first token.

1. Raw limits: a memcpy of the same bytes (into plain memory, and into a shared-memory mapping:
   the ceiling of `shm`) and a loopback TCP stream received into memory (the ceiling of `tcp`
   and, on a CPU host, of `nixl`).
2. Transfer only: every layer of an n-token prompt pushed through each backend's real sender and
   receiver (the workers' own classes) into leased blocks, timed from the first write to LANDED;
   limits and backends take turns, best of `--reps` each.
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
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from pdserve.bench.first_token import greedy_agreement, logit_error, ttft_comparison
from pdserve.bench.machine import environment
from pdserve.bench.turns import best_in_turns
from pdserve.kv_transfer.base import KVLayout
from pdserve.kv_transfer.shm import SharedKVPool
from pdserve.kv_transfer.timed_link import Link
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

class Memcpy:
    """One copy of the KV's bytes: into plain memory, or into a shared-memory mapping (what `shm`
    writes into: the fair ceiling for it, as such mappings may not get huge pages)."""

    def __init__(self, num_bytes: int, shared: bool) -> None:
        self.src = torch.ones(num_bytes, dtype=torch.uint8)
        self.pool = SharedKVPool((num_bytes,), torch.uint8) if shared else None
        self.dst = self.pool.tensor if shared else torch.empty_like(self.src)

    def once(self) -> None:
        self.dst.copy_(self.src)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class Loopback:
    """A TCP stream over 127.0.0.1, sent from a thread, received into one buffer with recv_into."""

    def __init__(self, num_bytes: int, chunk: int = 1 << 20) -> None:
        self.num_bytes, self.chunk = num_bytes, chunk
        self.server = socket.create_server(("127.0.0.1", 0))
        self.client = socket.create_connection(self.server.getsockname()[:2])
        self.conn, _ = self.server.accept()
        self.payload = memoryview(bytearray(chunk))
        self.sink = memoryview(bytearray(num_bytes))

    def _send(self) -> None:
        left = self.num_bytes
        while left:
            n = min(self.chunk, left)
            self.client.sendall(self.payload[:n])
            left -= n

    def once(self) -> None:
        t = threading.Thread(target=self._send)
        t.start()
        got = 0
        while got < self.num_bytes:
            got += self.conn.recv_into(self.sink[got:])
        t.join()

    def close(self) -> None:
        for s in (self.client, self.conn, self.server):
            s.close()


# -- 2. transfer only: `Link` (kv_transfer/timed_link.py) -------------------------------------------

def take_turns(contenders: dict[str, Any], reps: int) -> dict[str, float]:
    """Best seconds of each contender's `once()`, run in turns so that all see the same moments
    (a link times itself: its seconds leave out setting each round up)."""
    def timer(c: Any) -> Callable[[Any], float]:
        return (lambda _: c.once()) if isinstance(c, Link) else (lambda _: _timed(c.once))
    return best_in_turns([None] * (reps + 1), {name: timer(c) for name, c in contenders.items()})


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
    for n in args.sizes if "transfer" in args.parts else []:
        num_bytes = n * layout.slot_bytes * cfg.num_layers
        _log(f"{n} tokens ({num_bytes / 1e6:.0f} MB of KV): raw limits and {', '.join(backends)}, in turns")
        contenders: dict[str, Any] = {"memcpy": Memcpy(num_bytes, shared=False),
                                      "memcpy into shared memory": Memcpy(num_bytes, shared=True),
                                      "loopback tcp": Loopback(num_bytes)}
        for backend in backends:
            for encoding in ["raw"] + (["int8"] if backend == "tcp" and args.quantized else []):
                contenders[f"{backend}:{encoding}"] = Link(cfg, dtype, backend, n, encoding)
        try:
            best = take_turns(contenders, args.reps)
        finally:
            for c in contenders.values():
                c.close()
        raw = {name: num_bytes / best[name] / 1e9 for name in ("memcpy", "memcpy into shared memory", "loopback tcp")}
        _log("  raw: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in raw.items()))
        for name, seconds in best.items():
            if ":" not in name:
                continue
            backend, encoding = name.split(":")
            limit = "memcpy into shared memory" if backend == "shm" else "loopback tcp"
            gbs = num_bytes / seconds / 1e9
            rows.append({"backend": backend, "encoding": encoding, "tokens": n, "seconds": seconds, "kv_gbs": gbs,
                         "kv_bytes": num_bytes, "raw_limit": limit, "raw_gbs": raw[limit],
                         "fraction_of_raw": gbs / raw[limit], "raw_limits_gbs": raw})
            _log(f"  {name}: {gbs:.2f} GB/s of KV = {gbs / raw[limit]:.0%} of {limit}")
    result["transfer"] = rows
    result["ttft"] = []
    for backend in backends if "ttft" in args.parts else []:
        _log(f"time to first token, {args.ttft_tokens}-token prompt, {backend}")
        r = ttft_comparison(model, args.dtype, backend, args.ttft_tokens, args.reps, cfg.vocab_size)
        _log(f"  colocated {r['colocated_ttft_s'] * 1e3:.0f} ms, disaggregated {r['disaggregated_ttft_s'] * 1e3:.0f} ms "
             f"(+{r['added_fraction']:.1%})")
        result["ttft"].append(r)
    if args.quantized and "quantized" in args.parts:
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
    p.add_argument("--parts", default="transfer,ttft,quantized", help="which parts to run (comma-separated)")
    p.add_argument("--quick", action="store_true", help="small sizes, one rep: a smoke run of every part")
    p.add_argument("--out", default="results/bench_transfer.json")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.ttft_tokens, args.reps, args.quant_tokens = "256", 256, 1, 8
    args.sizes = [int(s) for s in str(args.sizes).split(",")]
    args.parts = set(args.parts.split(","))
    result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(markdown(result))
    _log(f"wrote {out}")
    return 0


def command(argv: list[str]) -> int:
    """`pdserve bench-transfer` as a process: NIXL's UCX threads sometimes abort the interpreter's
    own exit (std::terminate) after many agents came and went, so once every result is written
    the process leaves without running finalizers."""
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
