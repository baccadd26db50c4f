"""`--dtype auto` on a CPU: the activation dtype this CPU runs this model fastest in, measured.

Whether bfloat16 beats float32 depends on more than the instruction sets: with AMX it is two to
three times faster; with AVX512-BF16 alone it depends on the model's shapes; on an AVX2-only or
a plain AVX-512 CPU every bfloat16 operation converts to float32 and back; and a GGUF's 4-bit
layers run their own kernels whatever the activations. So the first engine of a model on a
machine times a short workload in each dtype and keeps the answer:

1. Both candidates (float32, bfloat16) are built in turn, one at a time, as engines of their own
   with a small KV pool, and each runs the workload three times (the first untimed, since the
   first step of a shape builds the math library's kernels): one long prompt's prefill, one
   stream's decode steps, the decode steps of a batch with a few hundred tokens of context each
   (their prompts untimed). Each phase keeps its fastest run. The prompts are long enough for
   attention and the KV cache's bytes to count, as they do in serving: with products that cost the
   same in either dtype (quantized weights on panels), a 256-token prompt and 16-token batch
   contexts measured float32 as faster on a Zen 4 EPYC, where served bfloat16 had 1.6x its
   throughput under 16 prompts of 400 tokens and a 0.6x first token for 1000.
2. bfloat16 is kept only where it is at least `BFLOAT16_MARGIN` faster over the three phases
   (the geometric mean of their ratios); otherwise float32, which is exact. A bfloat16 engine
   that fails to build or run on this CPU is logged and leaves float32.
3. The answer is cached per CPU, model, quantization and torch and pdserve versions in
   `$XDG_CACHE_HOME/pdserve/dtype-choices.json`, under a file lock: workers started together on
   one host measure once and agree, which a disaggregated pair must (its KV has one dtype).

Models too large to build twice quickly (`MAX_MEASURED_PARAMETERS`) or in the memory free (float32
weights at most a quarter of it) are not measured: for them, and on CUDA, `auto` is
`config.resolve_dtype`'s rule from the instruction sets alone, and the log says so.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Callable

import torch

from pdserve.config import EngineConfig, resolve_dtype
from pdserve.layers.measured import MeasuredChoices, machine_key
from pdserve.models.arch_config import ArchConfig
from pdserve.sampling_params import SamplingParams

log = logging.getLogger("pdserve.engine")

CANDIDATES = ("float32", "bfloat16")
BFLOAT16_MARGIN = 0.10  # bfloat16 rounds activations: it must buy at least this much speed
MAX_MEASURED_PARAMETERS = 2_000_000_000  # beyond this the workload alone takes most of a minute
ROUNDS = 3  # of the workload per candidate; the first is not timed

# The workload, in tokens: about ten seconds on two cores for the default model, once a machine
PREFILL_TOKENS = 1024
DECODE_STEPS = 16  # of one stream
PROMPT_TOKENS = 16  # of the one stream
BATCH, BATCH_STEPS = 8, 8  # streams of a decode batch, and its timed steps
BATCH_PROMPT_TOKENS = 192  # of each stream of the batch: its context


CHOICES = MeasuredChoices("dtype-choices.json", "dtype auto")


def cache_file() -> Path:
    return CHOICES.path


def choose_dtype(config: EngineConfig, device: torch.device, arch: ArchConfig,
                 make_engine: Callable[[EngineConfig], object]) -> torch.dtype:
    """`config.dtype` resolved; for `auto` on a CPU, the measured choice (cached; measured with
    engines from `make_engine` where the cache has none)."""
    if config.dtype != "auto" or device.type != "cpu":
        return resolve_dtype(config.dtype, device)
    prior = resolve_dtype("auto", device)
    reason = _not_measurable(arch)
    if reason:
        log.info("dtype auto: %s (from the instruction sets alone: %s)", _name(prior), reason)
        return prior
    key = choice_key(config.model, config.quantization)
    with CHOICES.locked():
        entry = CHOICES.read().get(key)
        if not _valid(entry):
            log.info("dtype auto: timing %s for this model on this CPU (once; cached in %s)",
                     " and ".join(CANDIDATES), cache_file())
            seconds, failed = {}, {}
            for name in CANDIDATES:
                try:
                    seconds[name] = measure(dataclasses.replace(_measuring(config, arch), dtype=name), make_engine)
                except Exception as e:  # a dtype this CPU cannot run is not a choice; float32 runs everywhere
                    if name == "float32":
                        raise
                    log.warning("dtype auto: %s does not run here (%s: %s)", name, type(e).__name__, e)
                    failed[name] = f"{type(e).__name__}: {e}"[:500]
            entry = {"dtype": "float32" if failed else pick(seconds), "seconds": seconds, "failed": failed,
                     "model": str(config.model),
                     "quantization": config.quantization, "threads": torch.get_num_threads(),
                     "cpu": _describe_cpu(), "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
            CHOICES.write(key, entry)
    log.info("dtype auto: %s (measured on this CPU: %s)", entry["dtype"], _summary(entry))
    return getattr(torch, entry["dtype"])


def pick(seconds: dict[str, dict[str, float]]) -> str:
    """bfloat16 where it is `BFLOAT16_MARGIN` faster than float32 over the phases, else float32."""
    fp32, bf16 = seconds["float32"], seconds["bfloat16"]
    ratio = math.exp(sum(math.log(bf16[phase] / fp32[phase]) for phase in fp32) / len(fp32))
    return "bfloat16" if ratio <= 1 - BFLOAT16_MARGIN else "float32"


def measure(config: EngineConfig, make_engine: Callable[[EngineConfig], object]) -> dict[str, float]:
    """Seconds of each phase of the workload on an engine built from `config`: the fastest of
    `ROUNDS - 1` timed runs after an untimed one."""
    engine = make_engine(config)
    best: dict[str, float] = {}
    for round_ in range(ROUNDS):
        for phase, seconds in _run_workload(engine).items():
            if round_:
                best[phase] = min(seconds, best.get(phase, math.inf))
    del engine
    return best


def choice_key(model: str, quantization: str | None) -> str:
    """What a measurement depends on: the machine (`machine_key`), the model's files, the
    quantization, the workload."""
    workload = [PREFILL_TOKENS, DECODE_STEPS, PROMPT_TOKENS, BATCH, BATCH_STEPS, BATCH_PROMPT_TOKENS]
    return machine_key(_model_identity(model), quantization, workload)


def recorded_choice(model: str, quantization: str | None = "auto") -> str | None:
    """The dtype `auto` measured for `model` on this machine, if an engine has measured it."""
    try:
        entry = CHOICES.read().get(choice_key(model, quantization))
    except OSError:
        return None
    return entry["dtype"] if _valid(entry) else None


def _valid(entry: object) -> bool:
    """A cache entry this code wrote: a candidate chosen, positive seconds of the same phases for each
    candidate timed, and float32 the choice where another failed."""
    if not isinstance(entry, dict) or entry.get("dtype") not in CANDIDATES or not isinstance(entry.get("seconds"), dict):
        return False
    failed = entry.get("failed") or {}
    if not isinstance(failed, dict) or "float32" in failed or (failed and entry["dtype"] != "float32"):
        return False
    timings = [entry["seconds"].get(name) for name in CANDIDATES if name not in failed]
    if not all(isinstance(t, dict) and t for t in timings) or len({frozenset(t) for t in timings}) != 1:
        return False
    return all(isinstance(s, (int, float)) and s > 0 for t in timings for s in t.values())


def _run_workload(engine) -> dict[str, float]:
    vocab = engine.model_config.vocab_size

    def prompt(n: int, seed: int) -> dict:
        return {"prompt_token_ids": [1 + (seed * 7919 + i * 31) % (vocab - 1) for i in range(n)]}

    longest = engine.max_model_len - 1  # a prompt leaves room for a token; a short model's are shorter
    batch_context = min(BATCH_PROMPT_TOKENS, longest - BATCH_STEPS)
    phases = {"prefill": [(prompt(min(PREFILL_TOKENS, longest), 0), 1)],
              "one stream": [(prompt(PROMPT_TOKENS, 1), DECODE_STEPS + 1)],
              "batch": [(prompt(batch_context, 2 + i), BATCH_STEPS + 1) for i in range(BATCH)]}
    seconds = {}
    for phase, requests in phases.items():
        for request, max_tokens in requests:
            engine.add_request(None, request, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        if phase == "batch":  # its prompts untimed: the phase is the decode steps over their contexts
            scheduler = engine.scheduler
            while scheduler.waiting or any(not r.output_token_ids for r in scheduler.running):
                engine.step()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        seconds[phase] = time.perf_counter() - start
    if engine.num_failed:
        raise RuntimeError("a request of the dtype measurement failed: see the log")
    return seconds


def _measuring(config: EngineConfig, arch: ArchConfig) -> EngineConfig:
    """An engine like `config`'s for the workload alone: its own small KV pool, no prefix cache
    (every round computes), no compiled steps."""
    tokens = 2 * (PREFILL_TOKENS + PROMPT_TOKENS + DECODE_STEPS + BATCH * (BATCH_PROMPT_TOKENS + BATCH_STEPS))
    kv_bytes = 2 * arch.num_layers * arch.kv_size * 4 * (tokens + BATCH * config.block_size)
    return EngineConfig(model=config.model, device=config.device, quantization=config.quantization,
                        kv_cache_memory=kv_bytes, block_size=config.block_size,
                        max_num_batched_tokens=PREFILL_TOKENS, max_num_seqs=BATCH, enable_prefix_caching=False,
                        seed=config.seed, num_threads=config.num_threads)


def _not_measurable(arch: ArchConfig) -> str | None:
    params = arch.num_parameters()
    if params > MAX_MEASURED_PARAMETERS:
        return f"{params / 1e9:.1f}B parameters take too long to time twice at start"
    free = _available_memory()
    if free is not None and 4 * params > free / 4:
        return f"its float32 weights ({4 * params / 2**30:.1f} GiB) would take over a quarter of the free memory"
    return None


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _model_identity(model: str) -> list:
    """The model's path with the size and modification time of each of its files."""
    path = Path(model).expanduser().resolve()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else []
    stats = []
    for f in files:
        st = f.stat()
        stats.append([f.name, st.st_size, st.st_mtime_ns])
    return [str(path), stats]


def _summary(entry: dict) -> str:
    if entry.get("failed"):
        return "; ".join(f"{name} failed: {why}" for name, why in entry["failed"].items())
    fp32, bf16 = entry["seconds"]["float32"], entry["seconds"]["bfloat16"]
    return ", ".join(f"{phase} bfloat16/float32 {bf16[phase] / fp32[phase]:.2f}x" for phase in fp32)


def _describe_cpu() -> str:
    from pdserve.layers.cpu import describe_cpu

    return describe_cpu()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
