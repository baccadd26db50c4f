"""`pdserve bench-parallel`: what tensor parallelism costs or gains on this machine, in one run.

Each setting (`--settings`: tp1, tp2, tp4 ..., and `tp2-ep` for a mixture of experts: experts whole
per rank) gets an engine of its own, warmed up; every round each engine in turn answers the same
requests: one prompt of `--prompt-len` tokens (its prefill: TTFT), one stream of `--decode-tokens`
tokens (its time per output token), and `--batch` streams at once (tokens a second). A worker's
threads are split among its ranks, so on a small CPU tensor parallelism divides the same cores
and adds the ranks' communication: the point is to measure that, not to hope.

The projection beside each measurement is the planner's rule for tensor parallelism
(`sim/catalog.py`): the one-rank step split N ways, plus two all-reduces per layer, each as long as
one all-reduce of the step's hidden states measured here between as many processes, as a worker's
ranks add (through shared memory up to 2048 rows and 64 MiB, gloo on loopback past that).
Reported: medians over `--rounds`, the ratio against tp1, the projection and its error; the JSON
holds every round, and a PNG plots the measured against the projected.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pdserve.bench.machine import environment
from pdserve.workload.results import write_json

ALLREDUCE_REPS = 200


def _say(message: str) -> None:
    print(f"[bench-parallel] {message}", file=sys.stderr, flush=True)


def settings_of(text: str) -> dict[str, dict]:
    """`tp1,tp2,tp2-ep` -> engine arguments per setting."""
    out = {}
    for name in (s.strip() for s in text.split(",") if s.strip()):
        size, _, ep = name.removeprefix("tp").partition("-")
        if not size.isdigit() or ep not in ("", "ep") or int(size) < 1:
            raise ValueError(f"a setting is tpN or tpN-ep, not {name!r}")
        out[name] = {"tensor_parallel_size": int(size), "expert_parallel": ep == "ep"}
    if "tp1" not in out:
        raise ValueError("the settings must include tp1: the baseline")
    return out


def measure_round(llm, prompt: list[int], decode_tokens: int, batch: int) -> dict:
    from pdserve import SamplingParams

    llm.engine.block_manager.reset_prefix_cache()
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], first)
    ttft = time.perf_counter() - t
    one = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    short = prompt[:16]
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": short}], one)
    stream = time.perf_counter() - t
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": [*short[:-1], short[-1] + i]} for i in range(batch)], one)
    together = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"ttft_ms": ttft * 1e3, "tpot_ms": stream / decode_tokens * 1e3, "batch_tok_s": tokens / together}


def _allreduce_rank(rank: int, size: int, path: str, hidden: int, rows: list[int], dtype: str, out) -> None:
    import torch

    from pdserve.engine.parallel.group import join

    torch.set_num_threads(1)
    group = join(rank, size, path, torch.device("cpu"), hidden)  # as a worker's ranks add
    times = {}
    for n in rows:
        x = torch.ones(n, hidden, dtype=getattr(torch, dtype))
        for _ in range(10):
            group.all_reduce(x)
        t = time.perf_counter()
        for _ in range(ALLREDUCE_REPS):
            group.all_reduce(x)
        times[n] = (time.perf_counter() - t) / ALLREDUCE_REPS
    if rank == 0:
        out.put(times)


def allreduce_seconds(size: int, hidden: int, rows: list[int], dtype: str) -> dict[int, float]:
    """Seconds of one all-reduce of [rows, hidden] among `size` processes here, per row count."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-parallel-") as d:
        procs = [ctx.Process(target=_allreduce_rank, args=(r, size, f"{d}/rendezvous", hidden, rows, dtype, out))
                 for r in range(size)]
        for p in procs:
            p.start()
        times = out.get(timeout=300)
        for p in procs:
            p.join(60)
    return times


def project(tp1: dict, size: int, layers: int, allreduce: dict[int, float], prompt_len: int, batch: int) -> dict:
    """The planner's rule: the one-rank time split `size` ways, plus two all-reduces a layer."""
    if size == 1:
        return dict(tp1)
    comm = lambda rows: 2 * layers * allreduce[rows]  # noqa: E731
    tpot = tp1["tpot_ms"] / 1e3 / size + comm(1)
    batch_step = batch / tp1["batch_tok_s"] / size + comm(batch)
    return {"ttft_ms": (tp1["ttft_ms"] / 1e3 / size + comm(prompt_len)) * 1e3, "tpot_ms": tpot * 1e3,
            "batch_tok_s": batch / batch_step}


def plot(results: dict, path: Path) -> Path:
    from pdserve.workload.plots import pyplot, save_figure

    plt = pyplot()
    metrics = (("ttft_ms", "prefill TTFT (ms)"), ("tpot_ms", "one stream: ms per token"),
               ("batch_tok_s", "batch: tokens/s"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(15, 4))
    names = list(results)
    for ax, (key, title) in zip(axes, metrics):
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [results[n]["measured"][key] for n in names], 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [results[n]["projected"][key] for n in names], 0.4, label="projected")
        ax.set_xticks(list(xs), names)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    return save_figure(plt, fig, "tensor parallelism: measured and projected", path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench-parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--settings", default="tp1,tp2", help="tpN or tpN-ep (experts whole per rank), tp1 among them")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--result-json", default="results/bench_parallel.json")
    args = p.parse_args(argv)
    try:
        settings = settings_of(args.settings)
    except ValueError as e:
        p.error(str(e))
    if args.rounds < 1 or args.prompt_len < 16 or args.decode_tokens < 1 or args.batch < 1:
        p.error("--rounds, --decode-tokens and --batch must be positive, --prompt-len at least 16")

    from pdserve import LLM
    from pdserve.models.registry import resolve_model

    model = resolve_model(args.model)
    engines = {}
    for name, extra in settings.items():
        t = time.perf_counter()
        engines[name] = LLM(model, dtype=args.dtype, quantization=args.quantization, **extra)
        _say(f"{name}: loaded in {time.perf_counter() - t:.1f} s, warm-up {engines[name].engine.warm_up():.1f} s")
    base = engines["tp1"].engine
    cfg, dtype = base.model_config, str(base.dtype).removeprefix("torch.")
    prompt = [(7 * i + 3) % (cfg.vocab_size - 1) + 1 for i in range(args.prompt_len)]
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, llm in engines.items():
            runs[name].append(measure_round(llm, prompt, args.decode_tokens, args.batch))
            row = runs[name][-1]
            _say(f"round {r + 1}/{args.rounds} {name}: TTFT {row['ttft_ms']:.0f} ms, {row['tpot_ms']:.1f} ms/token, "
                 f"batch {row['batch_tok_s']:.1f} tok/s")
    for llm in engines.values():
        llm.close()
    sizes = sorted({s["tensor_parallel_size"] for s in settings.values() if s["tensor_parallel_size"] > 1})
    allreduce = {n: allreduce_seconds(n, cfg.hidden_size, [1, args.batch, args.prompt_len], dtype) for n in sizes}
    for n, times in allreduce.items():
        _say(f"all-reduce among {n} processes: " + ", ".join(f"[{rows} x {cfg.hidden_size}] {s * 1e3:.3f} ms"
                                                            for rows, s in times.items()))
    measured = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()}
    results = {}
    for name, cell in measured.items():
        size = settings[name]["tensor_parallel_size"]
        projected = project(measured["tp1"], size, cfg.num_layers, allreduce.get(size, {}), args.prompt_len, args.batch)
        results[name] = {"measured": {k: round(v, 2) for k, v in cell.items()},
                         "projected": {k: round(v, 2) for k, v in projected.items()},
                         "vs_tp1": {k: round(cell[k] / measured["tp1"][k], 3) for k in cell}}
        _say(f"{name}: TTFT {cell['ttft_ms']:.0f} ms (projected {projected['ttft_ms']:.0f}), "
             f"{cell['tpot_ms']:.1f} ms/token (projected {projected['tpot_ms']:.1f}), batch {cell['batch_tok_s']:.1f} "
             f"tok/s (projected {projected['batch_tok_s']:.1f}); against tp1: {results[name]['vs_tp1']}")
    out = Path(args.result_json)
    write_json(out, {"machine": environment(), "settings": vars(args), "allreduce_s": {
        str(n): {str(k): v for k, v in t.items()} for n, t in allreduce.items()}, "results": results, "runs": runs})
    png = plot(results, out.with_suffix(".png"))
    _say(f"wrote {out} and {png}")
    print(json.dumps(results, indent=2))
    return 0
