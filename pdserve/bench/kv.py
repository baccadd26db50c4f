"""`pdserve bench-kv`: what the KV cache's features give on this machine, each against itself off,
in one run (one engine per setting, taking turns each round).

- `returning`: a conversation's second turn after other prompts pushed its prefix out of the pool:
  its TTFT with no host tier, a raw one and an int8 one (`--host-kv-memory`), and a disk tier
  under a small host one (`--disk-kv-path`, in a temporary directory), and a Valkey store under a
  small host one (`--kv-store`, a server this command starts on a private socket, where the `store`
  extra is installed), and where its KV came from (tokens by source: a tier that works leaves only
  the new tokens computed).
- `urgent`: short priority-0 prompts arriving while long priority-1 prompts compute in chunks:
  their TTFT with a running prompt pausing between chunks for them, and without.
- `journal`: what a durable pool's journal (`--durable-kv`) costs: eight streams decoding 128
  tokens each on one engine whose pool is a shared-memory file, the journal written between steps
  as a worker writes it, and not.

Reported per case and setting (medians over `--rounds`): the case's time in ms (TTFT; the eight
streams' time for `journal`) and the speed-up against the feature off; the JSON holds every round,
and a PNG plots the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pdserve.workload.args import chosen

CASES = ("returning", "urgent", "journal")
MEASURED = {"returning": "TTFT", "urgent": "TTFT", "journal": "8 streams x 128 tokens"}


def _say(message: str) -> None:
    print(f"[bench-kv] {message}", file=sys.stderr, flush=True)


def corpus(tokenizer, n: int) -> list[int]:
    """`n` tokens of real text (this package's own source), the same every run."""
    root = Path(__file__).resolve().parents[1]
    text = "".join(p.read_text() for p in sorted((root / "engine").glob("*.py")))
    ids = tokenizer.encode(text)
    while len(ids) < n:
        ids += ids
    return ids[:n]


def returning(llm, ids: list[int], round_: int, prompt_len: int) -> dict:
    """Turn 1, three prompts as long that fill the pool, then turn 2 (turn 1, its answer, 40 new
    tokens): turn 2's TTFT and the sources of the tokens it started from."""
    from pdserve import SamplingParams

    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    first = ids[:prompt_len]
    answer = llm.generate([{"prompt_token_ids": first}], SamplingParams(temperature=0, max_tokens=48,
                                                                        ignore_eos=True))[0].outputs[0].token_ids
    one = SamplingParams(temperature=0, max_tokens=1)
    for k in range(1, 4):
        llm.generate([{"prompt_token_ids": ids[k * prompt_len : (k + 1) * prompt_len]}], one)
    new = ids[4 * prompt_len + 40 * round_ : 4 * prompt_len + 40 * (round_ + 1)]
    before = dict(engine.scheduler.tokens_by_source)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": first + answer + new}], one)
    ttft = time.perf_counter() - start
    sources = {k: v - before[k] for k, v in engine.scheduler.tokens_by_source.items() if v != before[k]}
    return {"ms": ttft * 1e3, "sources": sources}


def local_store():
    """A Valkey server for the store setting (its password in this process's environment), or None
    where the `store` extra is not installed."""
    from pdserve.store_server import PASSWORD_ENV, LocalStore

    try:
        store = LocalStore(1 << 30)
    except RuntimeError as e:
        _say(f"no store setting: {e}")
        return None
    os.environ[PASSWORD_ENV] = store.password
    return store


def urgent(llm, ids: list[int], round_: int, prompt_len: int, pausing: bool) -> dict:
    """Four long priority-1 prompts, and a short priority-0 one every third step of the first
    twenty: the short ones' TTFTs."""
    from pdserve import SamplingParams

    engine = llm.engine
    sched = engine.scheduler
    engine.block_manager.reset_prefix_cache()
    own = sched._urgent_priority
    if not pausing:
        sched._urgent_priority = lambda budget: None
    try:
        sp = SamplingParams(temperature=0, max_tokens=4)
        for k in range(4):
            engine.add_request(None, {"prompt_token_ids": ids[k * prompt_len : (k + 1) * prompt_len] + [round_]}, sp,
                               priority=1)
        waiting: dict[str, tuple[object, float]] = {}
        ttfts: list[float] = []
        step = 0
        while engine.has_unfinished_requests():
            step += 1
            if step % 3 == 1 and step < 20:
                at = 4 * prompt_len + 30 * step
                rid = engine.add_request(None, {"prompt_token_ids": ids[at : at + 30] + [round_]}, sp, priority=0)
                waiting[rid] = (sched.requests[rid], time.perf_counter())
            engine.step()
            for rid, (req, sent) in list(waiting.items()):
                if req.output_token_ids:
                    ttfts.append((time.perf_counter() - sent) * 1e3)
                    del waiting[rid]
    finally:
        sched._urgent_priority = own
    return {"ms": statistics.median(ttfts), "ttft_max_ms": max(ttfts), "ttfts_ms": ttfts}


def journal(llm, ids: list[int], round_: int, prompt_len: int, durable) -> dict:
    """Eight prompts (`prompt_len`, at most 256 tokens) decoding 128 tokens each, stepped as a
    worker steps, the journal (`durable`, or None: not written) written between steps: their time."""
    from pdserve import SamplingParams

    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for k in range(8):
        n = min(prompt_len, 256)
        engine.add_request(None, {"prompt_token_ids": [round_] + ids[k * n : (k + 1) * n]}, sp)
    writes = durable.journal_writes if durable is not None else 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        if durable is not None:
            durable.tick(engine.scheduler.running)
        engine.step()
    out = {"ms": (time.perf_counter() - start) * 1e3}
    if durable is not None:
        out["journal_writes"] = durable.journal_writes - writes
    return out


def durable_llm(model: str, dtype: str, kv_cache_memory: str):
    """An engine whose pool is a durable one (a fresh shared-memory file, removed by the caller)."""
    import secrets

    from types import SimpleNamespace

    from pdserve.config import EngineConfig
    from pdserve.engine.durable_kv import DurableKV
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.kv_transfer.shm import SHM_DIR

    durable = DurableKV(os.path.join(SHM_DIR, f"pdserve-kv-{os.getpid()}-{secrets.token_hex(8)}"), model)
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, kv_cache_memory=kv_cache_memory,
                                    max_num_batched_tokens=512), kv_allocator=durable.allocate)
    durable.recover(engine.block_manager)
    engine.scheduler.durable = durable
    return SimpleNamespace(engine=engine), durable


def plot(results: dict, path: Path) -> Path:
    from pdserve.workload.plots import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4))
    axes = [axes] if len(results) == 1 else axes
    for ax, (case, by_setting) in zip(axes, results.items()):
        names = list(by_setting)
        ax.bar(names, [by_setting[n]["ms"] for n in names], color="tab:blue")
        ax.set_title(f"{case}: {MEASURED[case]} (ms, median)")
        ax.grid(True, axis="y", alpha=0.3)
    return save_figure(plt, fig, "KV cache features", path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench-kv", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=1200, help="tokens of each long prompt")
    p.add_argument("--kv-cache-memory", default="48MiB",
                   help="the pool, small enough that three long prompts push a fourth out")
    p.add_argument("--host-kv-memory", default="512MiB")
    p.add_argument("--disk-host-memory", default="0",
                   help="the host tier in front of the disk one (0: 64 blocks), small so the prefix reaches disk")
    p.add_argument("--result-json", default="results/bench_kv.json")
    args = p.parse_args(argv)
    cases = chosen(p, args.cases, CASES, "case")
    if args.rounds < 1 or args.prompt_len < 64:
        p.error("--rounds must be positive and --prompt-len at least 64")

    from pdserve import LLM
    from pdserve.models.registry import resolve_model

    model = resolve_model(args.model)
    pool = {"dtype": args.dtype, "kv_cache_memory": args.kv_cache_memory}
    disk = tempfile.TemporaryDirectory(prefix="pdserve-bench-kv-")
    settings = {"returning": {"no tier": {}, "host raw": {"host_kv_memory": args.host_kv_memory},
                              "host int8": {"host_kv_memory": args.host_kv_memory, "host_kv_encoding": "int8"},
                              "disk": {"host_kv_memory": args.disk_host_memory, "disk_kv_path": disk.name}},
                "urgent": {"no pausing": {}, "pausing": {}}, "journal": {"no journal": {}, "journal": {}}}
    store = local_store() if "returning" in cases else None
    if store is not None:
        settings["returning"]["store"] = {"host_kv_memory": args.disk_host_memory, "kv_store": store.url}
    durable = None
    runs: dict[str, dict[str, list[dict]]] = {}
    for case in cases:
        engines = {}
        for name, extra in settings[case].items():
            if case in ("urgent", "journal") and engines:
                engines[name] = next(iter(engines.values()))  # one engine, the feature switched in turns
                continue
            extra = {**pool, **extra} if case == "returning" else {"dtype": args.dtype, "max_num_batched_tokens": 512}
            if case == "journal":
                engines[name], durable = durable_llm(model, args.dtype, "256MiB")
            else:
                engines[name] = LLM(model, **extra)
            _say(f"{case}, {name}: warm-up {engines[name].engine.warm_up():.1f} s")
        ids = corpus(engines[next(iter(engines))].engine.tokenizer, 6 * args.prompt_len)
        runs[case] = {name: [] for name in engines}
        for r in range(args.rounds):
            for name, llm in engines.items():
                result = (returning(llm, ids, r, args.prompt_len) if case == "returning"
                          else journal(llm, ids, r, args.prompt_len, durable if name == "journal" else None) if case == "journal"
                          else urgent(llm, ids, r, args.prompt_len, pausing=name == "pausing"))
                runs[case][name].append(result)
                _say(f"round {r + 1}/{args.rounds} {case}, {name}: {MEASURED[case]} {result['ms']:.0f} ms"
                     + (f", tokens by source {result['sources']}" if "sources" in result else ""))
    if durable is not None:
        from pdserve.launcher import remove_durable_pools

        remove_durable_pools([os.path.basename(durable.pool_path)])
    results = {case: {name: {"ms": round(statistics.median(x["ms"] for x in rs), 1)}
                      for name, rs in by_name.items()} for case, by_name in runs.items()}
    for case, by_name in results.items():
        base = next(iter(by_name.values()))["ms"]
        for name, cell in by_name.items():
            cell["speedup"] = round(base / cell["ms"], 2)
            _say(f"{case}, {name}: {MEASURED[case]} {cell['ms']:.0f} ms, x{cell['speedup']} against "
                 f"{next(iter(by_name))}")
    out = Path(args.result_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    from pdserve.bench.machine import environment

    out.write_text(json.dumps({"machine": environment(), "settings": vars(args), "results": results,
                               "runs": runs}, indent=2))
    png = plot(results, out.with_suffix(".png"))
    disk.cleanup()
    if store is not None:
        store.stop()
    _say(f"wrote {out} and {png}")
    print(json.dumps(results, indent=2))
    return 0
