"""`pdserve profile`: this machine's step and transfer times for a model, fitted into the
simulator's performance model.

1. Prefill: prompts of several lengths, computed in chunks of `--max-num-batched-tokens`, one
   output token each: every step's shape (tokens, context) and time.
2. Decode: batches of several sizes at two contexts, a few dozen steps each (the steps that
   prefill their prompts count too: they are mixed steps).
3. Transfer: every layer of n-token prompts through each backend's real sender and receiver.
4. Fit the step model by least squares on relative error, coefficients kept non-negative, and
   latency + bytes / rate per backend. The JSON keeps every measured point beside the fit.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from pdserve.workload.results import write_json
from pdserve.engine.role import RoleHooks
from pdserve.engine.step_shape import StepShape, step_shape
from pdserve.sim.perf import LinearPerfModel

STEP_TERMS = ("base_s", "prefill_token_s", "prefill_attention_s", "decode_seq_s", "decode_context_s")


class StepTimer(RoleHooks):
    """Engine hooks that time every step the model runs, with the step's shape."""

    def __init__(self) -> None:
        self.samples: list[tuple[StepShape, float]] = []
        self._t0 = 0.0
        self._shape: StepShape | None = None

    def before_execute(self, step):
        self._shape, self._t0 = step_shape(step), time.perf_counter()
        return None

    def after_execute(self, step) -> None:
        self.samples.append((self._shape, time.perf_counter() - self._t0))


def _features(s: StepShape) -> list[float]:
    return [1.0, s.prefill_tokens, s.prefill_tokens * s.prefill_context, s.decode_seqs, s.decode_context]


def fit_steps(samples: list[tuple[StepShape, float]]) -> tuple[dict[str, float], float]:
    """Non-negative least squares on relative error; (coefficients, median relative error)."""
    x = np.array([_features(s) for s, _ in samples], dtype=np.float64)
    y = np.array([t for _, t in samples], dtype=np.float64)
    w = 1.0 / y[:, None]
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w, np.ones(len(y)), rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    error = float(np.median(np.abs(x @ coef - y) / y))
    return dict(zip(STEP_TERMS, map(float, coef))), error


def fit_link(points: list[tuple[int, float]]) -> dict[str, float]:
    """latency + bytes / rate through (bytes, seconds) points."""
    b = np.array([p[0] for p in points], dtype=np.float64)
    t = np.array([p[1] for p in points], dtype=np.float64)
    slope, intercept = np.polyfit(b, t, 1) if len(points) > 1 else (t[0] / b[0], 0.0)
    if slope <= 0 or intercept < 0:  # sizes too small to tell latency from rate: all rate, a bound
        return {"latency_s": 0.0, "bytes_per_s": float(np.max(b / t))}
    return {"latency_s": float(intercept), "bytes_per_s": float(1.0 / slope)}


def measure_steps(engine, timer: StepTimer, prefill_lengths, batches, contexts, decode_steps, seed: int) -> None:
    from pdserve.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size

    def run(prompts: list[list[int]], max_tokens: int) -> None:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for p in prompts:
            engine.add_request(None, {"prompt_token_ids": p}, sp)
        while engine.has_unfinished_requests():
            engine.step()

    def fresh(n: int) -> list[int]:  # random ids: no prefix-cache hit between prompts
        return [rng.randrange(10, vocab) for _ in range(n)]

    run([fresh(32)], 4)  # warm-up, not kept
    timer.samples.clear()
    for length in prefill_lengths:
        run([fresh(length)], 1)
        print(f"[profile] prefill {length} tokens", file=sys.stderr, flush=True)
    for ctx in contexts:
        for batch in batches:
            run([fresh(ctx) for _ in range(batch)], decode_steps)
            print(f"[profile] decode batch {batch} at context {ctx}", file=sys.stderr, flush=True)


def measure_links(arch, dtype, backends, token_counts, reps: int = 3) -> dict[str, list[tuple[int, float]]]:
    from pdserve.kv_transfer.timed_link import Link
    from pdserve.kv_transfer.base import KVLayout

    per_token = KVLayout.of(arch, dtype).slot_bytes * arch.num_layers
    out: dict[str, list[tuple[int, float]]] = {}
    for backend in backends:
        out[backend] = []
        for n in token_counts:
            link = Link(arch, dtype, backend, n)
            try:
                out[backend].append((n * per_token, min(link.once() for _ in range(reps))))
            finally:
                link.close()
        print(f"[profile] transfer over {backend}", file=sys.stderr, flush=True)
    return out


def run(args: argparse.Namespace) -> dict:
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.models.registry import resolve_model

    timer = StepTimer()
    config = EngineConfig(model=resolve_model(args.model), dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                          max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads,
                          enable_prefix_caching=False)
    engine = LLMEngine(config, timer)
    quick = args.quick
    lengths = [64, 256, 512] if quick else [64, 128, 256, 512, 1024, 2048]
    batches = [1, 4] if quick else [1, 4, 8, 16]
    contexts = [32, 256] if quick else [64, 512]
    limit = engine.max_model_len - 1
    measure_steps(engine, timer, [n for n in lengths if n < limit], batches, [c for c in contexts if c < limit // 2],
                  8 if quick else 24, args.seed)
    coef, error = fit_steps(timer.samples)
    links = measure_links(engine.model_config, engine.dtype, args.backends.split(","),
                          [64, 256] if quick else [256, 1024, 4096])
    from pdserve.kv_transfer.base import KVLayout

    kv_per_token = KVLayout.of(engine.model_config, engine.dtype).slot_bytes * engine.model_config.num_layers
    return {
        "model": args.model, "dtype": str(engine.dtype).removeprefix("torch."), "threads": args.threads,
        "max_num_batched_tokens": args.max_num_batched_tokens, "kv_bytes_per_token": kv_per_token,
        "step": coef, "step_fit_median_rel_error": error,
        "links": {b: fit_link(p) for b, p in links.items()},
        "points": {"steps": [[*asdict(s).values(), t] for s, t in timer.samples],
                   "step_columns": [*StepShape.__dataclass_fields__, "seconds"],
                   "links": {b: p for b, p in links.items()}},
    }


def from_steps(paths: list[str], links_from: dict) -> dict:
    """A profile fitted to steps workers logged while serving (`--record-steps`); the KV size and
    the links are `links_from`'s, a profile measured on the same machine."""
    samples, cpu_s = [], []
    for path in paths:
        for i, line in enumerate(Path(path).read_text().splitlines()):
            try:
                row = json.loads(line)
                shape = StepShape(*(int(row[k]) for k in StepShape.__dataclass_fields__))
                samples.append((shape, float(row["seconds"])))
                cpu_s.append(row.get("cpu_seconds"))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{i + 1}: not a step line (shape fields and seconds)") from None
    if len(samples) < len(STEP_TERMS):
        raise ValueError(f"{len(samples)} steps in {', '.join(paths)}: too few to fit")
    coef, error = fit_steps(samples)
    return {
        "model": links_from.get("model"), "dtype": links_from.get("dtype"), "threads": None, "from_steps": paths,
        "kv_bytes_per_token": links_from["kv_bytes_per_token"], "step": coef, "step_fit_median_rel_error": error,
        "engine_cpu_share": _cpu_share(samples, cpu_s), "links": links_from.get("links", {}),
        "points": {"steps": [[*asdict(s).values(), t] for s, t in samples],
                   "step_columns": [*StepShape.__dataclass_fields__, "seconds"]},
    }


def _cpu_share(samples: list[tuple[StepShape, float]], cpu_s: list[float | None]) -> float | None:
    """Of the logged steps' wall time, the share the engine thread spent on a core: below 1, it
    waited for the GIL, for its core, or (with several torch threads) for its helpers. None for
    logs written before the CPU time was kept."""
    if any(c is None for c in cpu_s):
        return None
    wall = sum(t for _, t in samples)
    return round(sum(cpu_s) / wall, 3) if wall > 0 else None


def perf_model(profile: dict, backend: str | None = None) -> LinearPerfModel:
    """The simulator's model from a profile's fit (and one backend's link, the first by default)."""
    links = profile.get("links") or {}
    link = links.get(backend) if backend else next(iter(links.values()), None)
    extra = {"link_bytes_per_s": link["bytes_per_s"], "link_latency_s": link["latency_s"]} if link else {}
    return LinearPerfModel(**profile["step"], kv_bytes_per_token=profile["kv_bytes_per_token"], **extra)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto", help="as the workers run it (auto: bfloat16 where the CPU has it)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads, as one worker of the cluster gets")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--backends", default="shm,tcp", help="KV transfer backends to time")
    p.add_argument("--quick", action="store_true", help="fewer sizes (about a minute on the tiny model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--from-steps", nargs="+", default=None, metavar="JSONL",
                   help="fit to the steps workers logged while serving (`pdserve serve --record-steps`) instead of "
                        "measuring; takes the KV size and links from --links-from")
    p.add_argument("--links-from", default=None, help="with --from-steps: a profile of this machine and model")
    p.add_argument("--out", default="results/profile.json")
    args = p.parse_args(argv)
    if args.from_steps:
        try:
            if not args.links_from:
                raise ValueError("--from-steps needs --links-from (a measured profile of the same model)")
            result = from_steps(args.from_steps, json.loads(Path(args.links_from).read_text()))
        except (OSError, ValueError, KeyError) as e:
            p.error(str(e))
    else:
        result = run(args)
    out = write_json(args.out, result)
    step = result["step"]
    print(f"step = {step['base_s'] * 1e3:.2f} ms + {step['prefill_token_s'] * 1e6:.1f} us/prefill token "
          f"+ {step['prefill_attention_s'] * 1e9:.2f} ns/(prefill token x context) + {step['decode_seq_s'] * 1e3:.2f} "
          f"ms/decode + {step['decode_context_s'] * 1e6:.2f} us/decode context token "
          f"(median error {result['step_fit_median_rel_error'] * 100:.1f}%)")
    if result.get("engine_cpu_share") is not None:
        print(f"the engine thread was on a core for {result['engine_cpu_share'] * 100:.0f}% of its steps' time")
    for backend, link in result["links"].items():
        print(f"{backend}: {link['latency_s'] * 1e3:.2f} ms + bytes / {link['bytes_per_s'] / 1e9:.2f} GB/s")
    print(f"wrote {out}", file=sys.stderr)
    return 0
