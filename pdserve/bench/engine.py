"""Engine benchmark: pdserve against this machine's limits, transformers and llama.cpp.

Per dtype, on the demo model (~102M parameters, random weights; `--model` for another):
1. machine: matmul GFLOP/s in the dtype and memory bandwidth, measured now (`pdserve.bench.machine`).
2. prefill: one L-token prompt in one chunk, one token generated; tokens/s and MFU.
3. decode: B requests of 64-token prompts; only steady decode is timed, from the moment every request
   holds its first token to the end; tokens/s and MBU.
4. offline: a seeded mixed-length workload, all submitted at once to our engine, in static
   left-padded batches to transformers; output tokens/s.
Then on the default model (SmolLM2-135M GGUF): batch-1 decode, ours vs llama-cpp-python.
Every timed configuration runs once untimed first. Progress goes to stderr, one summary line per
configuration to stdout, everything to the JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

import torch

from pdserve import LLM
from pdserve.bench.machine import MachineLimits, current_rss_bytes, environment, measure, peak_rss_bytes
from pdserve.bench.model_arithmetic import (
    BYTE_COUNT, FLOP_COUNT, decode_step_bytes, matmul_weight_bytes, non_embedding_parameters, prefill_flops,
)
from pdserve.bench.runners import (
    hf_generate, llamacpp_decoder, load_transformers, ours_decode, ours_offline, ours_prefill, torch_dtype,
)
from pdserve.bench.turns import best_in_turns
from pdserve.bench.workload import FULL, QUICK, Sizes, Workload, make_workload
from pdserve.models.arch_config import ArchConfig

DTYPES = ("float32", "bfloat16")
COMPILED = "bfloat16_compiled"  # the default model's bfloat16 engine with compiled decode graphs
AS_STORED = "gguf_"  # + dtype: the default model's own 4- and 8-bit weights, activations in dtype
LLAMA_CPP_NOTE = (
    "llama.cpp computes on the GGUF's quantized weights as they are (Q4_1: ~5 bits per weight), as ours "
    "does in the gguf_* rows (the default); the float32 and bfloat16 rows dequantize them at load and read "
    "~3x (bfloat16) or ~6x (float32) the bytes per token."
)


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("inf")


# -- one dtype on the demo model ---------------------------------------------------------------


def bench_dtype(model_path: Path, dtype: str, sizes: Sizes, workload: Workload, limits: MachineLimits,
                with_hf: bool) -> dict[str, Any]:
    timings, cfg, memory = _time_configurations(model_path, dtype, sizes, workload, with_hf)
    label = f"{model_path.name} {dtype}"
    result: dict[str, Any] = {
        "prefill": [_prefill_row(cfg, n, limits, timings["prefill"][n]) for n in sizes.prefill_lengths],
        "decode": [_decode_row(cfg, dtype, b, sizes, limits, timings["decode"][b]) for b in sizes.decode_batches],
        "offline": _offline_row(sizes, workload, timings["offline"]),
        "memory": memory | {"peak_rss_bytes": peak_rss_bytes()},  # so far, transformers included
    }
    for row in result["prefill"]:
        _say(_line(f"{label} prefill {row['prompt_tokens']}", row, "tokens_per_s", "tok/s", "mfu_pct", "MFU"))
    for row in result["decode"]:
        _say(_line(f"{label} decode batch {row['batch']}", row, "tokens_per_s", "tok/s", "mbu_pct", "MBU"))
    _say(_line(f"{label} offline {sizes.offline_requests} requests", result["offline"],
               "output_tokens_per_s", "output tok/s"))
    mem = result["memory"]
    _say(f"{label} memory: peak RSS {mem['peak_rss_bytes'] / 2**20:.0f} MiB, weights "
         f"{mem['weight_bytes'] / 2**20:.0f} MiB, KV cache {mem['kv_cache_bytes'] / 2**20:.0f} MiB "
         f"({mem['kv_blocks']} blocks)")
    return result


def _prefill_row(cfg: ArchConfig, length: int, limits: MachineLimits, timings: dict[str, float]) -> dict[str, Any]:
    matmul, attention = prefill_flops(cfg, length)
    row: dict[str, Any] = {"prompt_tokens": length}
    for name, seconds in timings.items():
        row[name] = {
            "seconds": seconds,
            "tokens_per_s": _rate(length, seconds),
            "mfu_pct": 100 * _rate(matmul, seconds) / 1e9 / limits.matmul_gflops,
            "mfu_incl_attention_pct": 100 * _rate(matmul + attention, seconds) / 1e9 / limits.matmul_gflops,
        }
    return _compare(row, "tokens_per_s")


def _decode_row(cfg: ArchConfig, dtype: str, batch: int, sizes: Sizes, limits: MachineLimits,
                timings: dict[str, float]) -> dict[str, Any]:
    # The timed steps compute positions P .. P+steps-1 of requests already holding P+1 tokens.
    mean_context = sizes.decode_prompt_len + 1 + (sizes.decode_steps - 1) / 2
    step_bytes = decode_step_bytes(cfg, torch_dtype(dtype).itemsize, batch, mean_context)
    row: dict[str, Any] = {"batch": batch, "prompt_tokens": sizes.decode_prompt_len, "steps": sizes.decode_steps}
    tokens = batch * sizes.decode_steps
    for name, seconds in timings.items():
        steps_per_s = _rate(sizes.decode_steps, seconds)
        row[name] = {
            "seconds": seconds,
            "tokens": tokens,
            "tokens_per_s": _rate(tokens, seconds),
            "ms_per_step": 1000 / steps_per_s,
            "mbu_pct": 100 * step_bytes * steps_per_s / 1e9 / limits.read_gbs,
        }
    return _compare(row, "tokens_per_s")


def _offline_row(sizes: Sizes, workload: Workload, timings: dict[str, float]) -> dict[str, Any]:
    output_tokens = sizes.offline_requests * sizes.offline_new_tokens
    row: dict[str, Any] = {
        "requests": sizes.offline_requests,
        "prompt_tokens": sum(map(len, workload.offline[0])),
        "output_tokens": output_tokens,
    }
    for name, seconds in timings.items():
        row[name] = {"seconds": seconds, "output_tokens_per_s": _rate(output_tokens, seconds)}
    if "transformers" in row:
        row["transformers"]["static_batch"] = sizes.hf_batch
    return _compare(row, "output_tokens_per_s")


def _time_configurations(model_path: Path, dtype: str, sizes: Sizes, workload: Workload,
                         with_hf: bool) -> tuple[dict[str, Any], ArchConfig, dict[str, int]]:
    """Seconds of each configuration by contender ({"prefill": {512: {"ours": s, ...}}, ...}),
    ours and transformers taking turns; and our model's config and memory use."""
    hf = load_transformers(model_path, dtype) if with_hf else None

    def both(label: str, inputs: list, ours: Callable[[Any], float], theirs: Callable[[Any], float]):
        contenders = {"ours": ours} | ({"transformers": theirs} if hf is not None else {})
        return _turn_about(f"{dtype}: {label}", inputs, contenders)

    # Prefill gets its own engine with a token budget of the longest prompt: one chunk per prompt.
    llm = LLM(str(model_path), dtype=dtype, max_num_batched_tokens=max(sizes.prefill_lengths, default=1),
              max_num_seqs=1, kv_cache_memory=sizes.kv_cache_memory)
    timings: dict[str, Any] = {"prefill": {
        n: both(f"prefill {n}", prompts, lambda p: ours_prefill(llm, p), lambda p: hf_generate(hf, [p], 1)[0])
        for n, prompts in workload.prefill.items()
    }}
    del llm
    gc.collect()

    llm = LLM(str(model_path), dtype=dtype, kv_cache_memory=sizes.kv_cache_memory, max_num_batched_tokens=512,
              max_num_seqs=64)
    steps, new_tokens, hf_batch = sizes.decode_steps, sizes.offline_new_tokens, sizes.hf_batch
    timings["decode"] = {
        b: both(f"decode batch {b}", batches, lambda x: ours_decode(llm, x, steps),
                lambda x: hf_generate(hf, x, 1 + steps)[1])
        for b, batches in workload.decode.items()
    }
    timings["offline"] = both(
        f"offline, {sizes.offline_requests} requests", [workload.offline_warmup, *workload.offline],
        lambda ps: ours_offline(llm, ps, new_tokens),
        lambda ps: sum(hf_generate(hf, ps[i : i + hf_batch], new_tokens)[0] for i in range(0, len(ps), hf_batch)),
    )
    runner = llm.engine.runner
    memory = {
        # from the architecture: packed matmul weights are not module parameters
        "weight_bytes": llm.engine.model_config.num_parameters() * llm.engine.dtype.itemsize,
        "kv_cache_budget_bytes": llm.engine.config.kv_cache_memory,
        "kv_cache_bytes": runner.kv_cache.nbytes,
        "kv_blocks": llm.engine.block_manager.num_blocks,
        "rss_with_engines_bytes": current_rss_bytes(),  # ours, and transformers' copy when compared
    }
    cfg = llm.engine.model_config
    del llm, runner, hf
    gc.collect()
    return timings, cfg, memory


def _turn_about(label: str, inputs: list, contenders: dict[str, Callable[[Any], float]]) -> dict[str, float]:
    _log(label)
    return best_in_turns(inputs, contenders)


def _compare(row: dict[str, Any], key: str) -> dict[str, Any]:
    if "transformers" in row:
        row["ours_over_transformers"] = row["ours"][key] / row["transformers"][key]
    return row


def _line(label: str, row: dict[str, Any], key: str, unit: str, pct: str | None = None, pct_name: str = "") -> str:
    parts = [f"{label}: ours {row['ours'][key]:.1f} {unit}"]
    if pct:
        parts[0] += f" ({pct_name} {row['ours'][pct]:.0f}%)"
    if "transformers" in row:
        parts.append(f"transformers {row['transformers'][key]:.1f} {unit}")
        parts.append(f"ours/transformers {row['ours_over_transformers']:.2f}x")
    return " | ".join(parts)


# -- the default model: ours vs llama.cpp ------------------------------------------------------


def bench_default_model(limits: dict[str, MachineLimits], sizes: Sizes, seed: int,
                        compiled: bool = False, gguf: Path | None = None) -> dict[str, Any]:
    """Batch-1 decode of a GGUF model (`gguf`; default: the default model): ours at each dtype of
    `limits` (and with `compiled`, bfloat16 with compiled decode graphs), and llama.cpp; and the
    bytes a decode step of ours reads against the file's own matmul tensors'."""
    from pdserve.models.default_model import default_model_path
    from pdserve.models.gguf_reader import matmul_tensor_bytes

    try:
        path = gguf or default_model_path()
    except FileNotFoundError as e:
        _say(f"default model: skipped ({e})")
        return {"skipped": str(e)}
    steps = sizes.default_decode_steps
    engines: dict[str, LLM] = {}
    for dtype in limits:  # the file's values in the dtype, and its own 4- and 8-bit weights with dtype activations
        engines[dtype] = LLM(str(path), dtype=dtype, quantization="none", kv_cache_memory="256MiB")
        engines[AS_STORED + dtype] = LLM(str(path), dtype=dtype, quantization="auto", kv_cache_memory="256MiB")
    if compiled and "bfloat16" in limits:
        _log("default model: compiling the decode graphs (minutes)")
        engines[COMPILED] = LLM(str(path), dtype="bfloat16", quantization="none", kv_cache_memory="256MiB",
                                compile_decode=True)
        if not engines[COMPILED].engine.runner.compiled.warm_up():
            raise RuntimeError("the decode graphs did not compile; see the log")
    weight_bytes = {name: matmul_weight_bytes(llm.engine.runner.model) for name, llm in engines.items()}
    cfg = next(iter(engines.values())).engine.model_config
    one = replace(sizes, prefill_lengths=(), decode_batches=(1,), offline_requests=0)
    prompts = make_workload(one, cfg.vocab_size, seed).decode[1]  # [warm-up, rep 1, ...], batches of one
    contenders = {dtype: (lambda b, llm=llm: ours_decode(llm, b, steps)) for dtype, llm in engines.items()}
    result: dict[str, Any] = {"path": str(path), "file_bytes": path.stat().st_size, "decode_steps": steps,
                              "file_matmul_bytes": matmul_tensor_bytes(path),
                              "matmul_bytes_read": {name: weight_bytes[name] for name in engines}}
    for dtype in limits:  # the file's own blocks: a decode step reads the file's bytes, and no more
        ratio = weight_bytes[AS_STORED + dtype] / result["file_matmul_bytes"]
        _say(f"{path.name} as stored, {dtype} activations: a decode step reads {weight_bytes[AS_STORED + dtype] / 2**20:.1f} "
             f"MiB of matmul weights; the file holds {result['file_matmul_bytes'] / 2**20:.1f} MiB of them ({ratio:.3f}x)")
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: installed, but its shared library will not load
        _say(f"default model: no llama.cpp comparison, llama-cpp-python does not import ({e})")
        result["llama_cpp"] = {"skipped": f"llama-cpp-python does not import: {e}"}
    else:
        contenders["llama_cpp"] = llamacpp_decoder(path, sizes.decode_prompt_len + steps + 16, steps)
    seconds = _turn_about("default model: decode batch 1", prompts, contenders)
    del engines, contenders
    gc.collect()

    mean_context = sizes.decode_prompt_len + 1 + (steps - 1) / 2
    for dtype in [d for d in seconds if d != "llama_cpp"]:
        activations = "bfloat16" if dtype == COMPILED else dtype.removeprefix(AS_STORED)
        m = limits[activations]
        itemsize = torch_dtype(activations).itemsize
        kv_bytes = decode_step_bytes(cfg, itemsize, 1, mean_context) - decode_step_bytes(cfg, itemsize, 1, 0)
        step_bytes = weight_bytes[dtype] + kv_bytes  # every matmul weight read once, and the context's KV
        tokens_per_s = _rate(steps, seconds[dtype])
        result[dtype] = {"ours": {"seconds": seconds[dtype], "tokens": steps, "tokens_per_s": tokens_per_s,
                                  "mbu_pct": 100 * step_bytes * tokens_per_s / 1e9 / m.read_gbs}}
    if "llama_cpp" in seconds:
        tokens_per_s = _rate(steps, seconds["llama_cpp"])
        bandwidth = max(m.read_gbs for m in limits.values())
        result["llama_cpp"] = {
            "seconds": seconds["llama_cpp"], "tokens": steps, "tokens_per_s": tokens_per_s,
            "threads": torch.get_num_threads(),
            # Bytes per token ~ the file: its quantized weights, each read once per token.
            "mbu_pct_approx": 100 * path.stat().st_size * tokens_per_s / 1e9 / bandwidth,
            "note": LLAMA_CPP_NOTE,
        }
    for dtype in [d for d in seconds if d != "llama_cpp"]:
        ours = result[dtype]["ours"]
        line = f"{path.stem} {dtype} decode batch 1: ours {ours['tokens_per_s']:.1f} tok/s (MBU {ours['mbu_pct']:.0f}%)"
        if "llama_cpp" in seconds:
            theirs = result["llama_cpp"]["tokens_per_s"]
            ratio = result[dtype]["ours_over_llama_cpp"] = ours["tokens_per_s"] / theirs
            line += f" | llama.cpp (GGUF as is) {theirs:.1f} tok/s | ours/llama.cpp {ratio:.2f}x"
        _say(line)
    return result


# -- the run ---------------------------------------------------------------------------------------


def _log(message: str) -> None:
    print(f"[bench-engine {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _say(line: str) -> None:
    print(line, flush=True)


def demo_model_path() -> Path:
    from pdserve.models.default_model import default_cache_dir

    return default_cache_dir().parent / "models" / "demo"


def run(model_path: Path, dtypes: list[str], sizes: Sizes, seed: int = 0, with_hf: bool = True,
        with_default_model: bool = True, compiled: bool = False, gguf: Path | None = None) -> dict[str, Any]:
    """Every section in turn; returns what the JSON holds."""
    started = time.time()
    torch.manual_seed(seed)
    cfg = ArchConfig.from_hf_config(json.loads((model_path / "config.json").read_text()))
    workload = make_workload(sizes, cfg.vocab_size, seed)
    load = os.getloadavg()[0]
    if load > 0.5 * (os.cpu_count() or 1):
        _log(f"load average {load:.1f} on {os.cpu_count()} CPUs: something else is running; expect noise")
    results: dict[str, Any] = {
        "benchmark": "pdserve.bench.engine",
        "seed": seed,
        "sizes": asdict(sizes),
        "environment": environment(),
        "flop_count": FLOP_COUNT,
        "byte_count": BYTE_COUNT,
        "model": {
            "path": str(model_path),
            "parameters": cfg.num_parameters(),
            "non_embedding_parameters": non_embedding_parameters(cfg),
            "arch": asdict(cfg),
        },
        "dtypes": {},
    }
    limits: dict[str, MachineLimits] = {}
    for dtype in dtypes:
        _log(f"{dtype}: measuring the machine")
        limits[dtype] = m = measure(dtype, sizes.matmul_size, sizes.buffer_mib)
        _say(f"machine {dtype}: matmul {m.matmul_gflops:.0f} GFLOP/s, read {m.read_gbs:.1f} GB/s, "
             f"copy {m.copy_gbs:.1f} GB/s, {m.threads} threads")
        results["dtypes"][dtype] = {"machine": asdict(m)}
        results["dtypes"][dtype] |= bench_dtype(model_path, dtype, sizes, workload, m, with_hf)
    if with_default_model:
        results["default_model"] = bench_default_model(limits, sizes, seed, compiled, gguf)
    results["peak_rss_bytes"] = peak_rss_bytes()
    results["environment"]["load_average_end"] = os.getloadavg()
    results["wall_seconds"] = time.time() - started
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench-engine", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a Hugging Face model directory (default: the demo model)")
    parser.add_argument("--dtype", action="append", choices=DTYPES, help="repeatable; default: both")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, one repetition (< 3 minutes)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_engine.json"))
    parser.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True,
                        help="compare with transformers (default: on)")
    parser.add_argument("--default-model", action=argparse.BooleanOptionalAction, default=True,
                        help="also bench the default GGUF model against llama.cpp (default: on)")
    parser.add_argument("--gguf", type=Path, help="the GGUF file benched against llama.cpp (default: the "
                        "default model): its weights as stored, and the bytes a decode step reads of them")
    parser.add_argument("--compile-decode", action="store_true",
                        help="add the default model in bfloat16 with compiled decode graphs (compiles for minutes)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    model_path = args.model or demo_model_path()
    if args.model is None and not (model_path / "config.json").is_file():
        from pdserve.models.synthetic import write_model

        _log(f"writing the demo model to {model_path}")
        write_model(model_path, "demo")
    if not (model_path / "config.json").is_file():
        parser.error(f"{model_path} is not a Hugging Face model directory (no config.json)")
    if args.transformers:
        try:
            import transformers  # noqa: F401
        except ImportError:
            parser.error("transformers is not installed; install it or pass --no-transformers")

    dtypes = list(dict.fromkeys(args.dtype or DTYPES))
    results = run(model_path, dtypes, QUICK if args.quick else FULL, args.seed, args.transformers,
                  args.default_model, args.compile_decode, args.gguf)
    results["quick"] = args.quick
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    _log(f"wrote {args.out} ({results['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
