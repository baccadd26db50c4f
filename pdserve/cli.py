"""The `pdserve` command."""

from __future__ import annotations

import argparse
import sys
import time

from pdserve.config import EngineConfig
from pdserve.flags import add_flags, flag_argv, flag_kwargs
from pdserve.models.presets import ARCHITECTURES

DEFAULT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about autumn.",
    "Explain in two sentences why the sky is blue.",
]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, EngineConfig, "engine")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig's arguments from the engine flags, all but the model: the caller resolves it
    (a preset or a download) where it loads it."""
    return flag_kwargs(EngineConfig, args, skip=frozenset({"model"}))


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams
    from pdserve.models.registry import resolve_model

    t0 = time.perf_counter()
    llm = LLM(resolve_model(args.model), **engine_kwargs(args))
    print(f"[pdserve] loaded {args.model or 'default model'} ({llm.engine.dtype}) in "
          f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.sampling_seed)
    tok = llm.get_tokenizer()
    engine = llm.engine
    prompts = args.prompt or DEFAULT_PROMPTS
    for i, text in enumerate(prompts):
        if tok.chat_template and not args.raw:
            prompt = {"prompt": text, "prompt_token_ids": tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)}
        else:
            prompt = text
        engine.add_request(f"cli-{i}", prompt, params)
    texts: dict[str, str] = {f"cli-{i}": "" for i in range(len(prompts))}
    t0 = time.perf_counter()
    num_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] += out.outputs[0].delta_text
            num_tokens += len(out.outputs[0].delta_token_ids)
            if len(prompts) == 1:
                print(out.outputs[0].delta_text, end="", flush=True)
    elapsed = time.perf_counter() - t0
    if len(prompts) == 1:
        print()
    else:
        for i, text in enumerate(prompts):
            print(f">>> {text}\n{texts[f'cli-{i}'].strip()}\n")
    print(f"[pdserve] {num_tokens} tokens in {elapsed:.2f}s ({num_tokens / elapsed:.1f} tokens/s)", file=sys.stderr)
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    from pdserve.models.synthetic import write_model

    out = write_model(args.out_dir, args.preset, args.architecture, seed=args.seed)
    print(f"wrote {args.preset} ({args.architecture}) model to {out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pdserve.models.loader import load_checkpoint
    from pdserve.models.registry import resolve_model

    load_checkpoint(resolve_model(args.model)).save(args.out_dir)
    print(f"exported {args.model} to {args.out_dir}")
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from pdserve.worker.main import run_worker

    return run_worker(args, engine_kwargs(args))


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags as given, for a child process (`--model` and `--threads` excepted: the
    launcher sets each worker's threads, `--threads` where given, else its share of the cores)."""
    return flag_argv(EngineConfig, args, skip=frozenset({"model", "num_threads"}))


def cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.launcher import pool_engine_argv

    for role in ("prefill", "decode"):  # refused now, not in each worker as it starts
        pool_engine_argv(args, role)
    if args.standby and args.ray:
        raise SystemExit("pdserve serve: --standby keeps spare worker processes under this command; not with --ray "
                         "(Ray starts a failed actor again itself)")
    if args.local_kv_store and (args.kv_store or args.ray):
        raise SystemExit("pdserve serve: --local-kv-store starts a store for this host's workers; not with "
                         "--kv-store (a store already running) or --ray (give the workers --kv-store URL)")
    if not 1 <= args.routers <= 16:
        raise SystemExit("pdserve serve: --routers takes 1 to 16")
    if args.ray:
        from pdserve.on_ray.driver import run_serve_on_ray

        return run_serve_on_ray(args, engine_argv(args))
    from pdserve.launcher import run_serve

    return run_serve(args, engine_argv(args))


def cmd_scale(args: argparse.Namespace) -> int:
    from pdserve.on_ray.driver import run_scale

    return run_scale(args)


def cmd_router(args: argparse.Namespace) -> int:
    from pdserve.router.main import run_router

    return run_router(args)


# Commands with parsers of their own: name -> (module, function taking the rest of argv).
# Commands that parse their own flags, each imported only when it runs.


def _bench(argv: list[str]) -> int:
    from pdserve.bench.cli import main
    return main(argv)


def _bench_engine(argv: list[str]) -> int:
    from pdserve.bench.engine import main
    return main(argv)


def _bench_router(argv: list[str]) -> int:
    from pdserve.bench.router import main
    return main(argv)


def _bench_transfer(argv: list[str]) -> int:
    from pdserve.bench.transfer import command
    return command(argv)


def _bench_structured(argv: list[str]) -> int:
    from pdserve.bench.structured import main
    return main(argv)


def _bench_speculative(argv: list[str]) -> int:
    from pdserve.bench.speculative import main
    return main(argv)


def _bench_kv(argv: list[str]) -> int:
    from pdserve.bench.kv import main
    return main(argv)


def _bench_parallel(argv: list[str]) -> int:
    from pdserve.bench.parallel import main
    return main(argv)


def _bench_precision(argv: list[str]) -> int:
    from pdserve.bench.precision import main
    return main(argv)


def _bench_crash(argv: list[str]) -> int:
    from pdserve.bench.crash import main
    return main(argv)


def _dashboard(argv: list[str]) -> int:
    from pdserve.telemetry.dashboard import main
    return main(argv)


def _top(argv: list[str]) -> int:
    from pdserve.telemetry.top import main
    return main(argv)


def _shadow_report(argv: list[str]) -> int:
    from pdserve.telemetry.shadow_report import main
    return main(argv)


def _profile(argv: list[str]) -> int:
    from pdserve.sim.profile import main
    return main(argv)


def _simulate(argv: list[str]) -> int:
    from pdserve.sim.simulate import main
    return main(argv)


def _simulate_trace(argv: list[str]) -> int:
    from pdserve.sim.trace_sim_cli import main
    return main(argv)


def _plan(argv: list[str]) -> int:
    from pdserve.sim.plan_cli import main
    return main(argv)


OWN_PARSERS = {"bench": _bench, "bench-engine": _bench_engine, "bench-router": _bench_router,
               "bench-transfer": _bench_transfer, "bench-structured": _bench_structured,
               "bench-speculative": _bench_speculative, "bench-kv": _bench_kv, "bench-crash": _bench_crash,
               "bench-parallel": _bench_parallel, "bench-precision": _bench_precision,
               "profile": _profile, "simulate": _simulate,
               "simulate-trace": _simulate_trace, "plan": _plan, "dashboard": _dashboard, "top": _top,
               "shadow-report": _shadow_report}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from prompts (streams a single prompt)")
    add_engine_args(gen)
    gen.add_argument("prompt", nargs="*", help="prompts (default: a few example questions)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true",
                     help="do not wrap prompts in the chat template (a model without one always takes them raw)")
    gen.set_defaults(func=cmd_generate)

    mk = sub.add_parser("make-model", help="write a deterministic random-weight model (tests, demos)")
    mk.add_argument("out_dir")
    mk.add_argument("--preset", choices=["tiny", "demo"], default="tiny")
    mk.add_argument("--architecture", choices=list(ARCHITECTURES), default="llama")
    mk.add_argument("--seed", type=int, default=0)
    mk.set_defaults(func=cmd_make_model)

    ex = sub.add_parser("export", help="write any loadable model (GGUF included) as a Hugging Face directory")
    ex.add_argument("model")
    ex.add_argument("out_dir")
    ex.set_defaults(func=cmd_export)

    from pdserve.worker.main import add_worker_args

    wk = sub.add_parser("worker", help="one worker (prefill, decode or both) with its HTTP control endpoint")
    add_engine_args(wk)
    add_worker_args(wk)
    wk.set_defaults(func=cmd_worker)

    from pdserve.launcher import add_serve_args
    from pdserve.on_ray.driver import add_ray_args, add_scale_args
    from pdserve.router.main import add_router_args

    sv = sub.add_parser("serve", help="the cluster: router + prefill and decode workers (by default the layout that suits this host), as local "
                        "processes or, with --ray, as actors on a Ray cluster")
    add_engine_args(sv)
    add_serve_args(sv)
    add_ray_args(sv)
    sv.set_defaults(func=cmd_serve)

    sc = sub.add_parser("scale", help="change the pools of a running `pdserve serve --ray` (drains what it removes)")
    add_scale_args(sc)
    sc.set_defaults(func=cmd_scale)

    rt = sub.add_parser("router", help="the OpenAI-compatible router in front of registered workers")
    add_router_args(rt)
    rt.set_defaults(func=cmd_router)

    sub.add_parser("bench", help="load any OpenAI-compatible server (TTFT, TPOT, goodput, plots); "
                   "'bench compare': colocated vs disaggregated on this machine", add_help=False)
    sub.add_parser("bench-engine", help="engine speed against machine limits and transformers",
                   add_help=False)
    sub.add_parser("simulate", help="a cluster's serving metrics for a workload, from a profile, without a model",
                   add_help=False)
    sub.add_parser("simulate-trace", help="the P:D controller over a traffic trace against static splits, simulated",
                   add_help=False)
    sub.add_parser("plan", help="the cheapest colocated or disaggregated cluster for a traffic profile and SLA",
                   add_help=False)
    sub.add_parser("profile", help="this machine's step and transfer times for a model, fitted for the simulator",
                   add_help=False)
    sub.add_parser("bench-router", help="latency the router adds and requests it routes per second",
                   add_help=False)
    sub.add_parser("bench-transfer", help="KV transfer speed per backend against raw limits; TTFT added",
                   add_help=False)
    sub.add_parser("bench-structured", help="what structured outputs cost: mask per token, throughput with a schema",
                   add_help=False)
    sub.add_parser("bench-speculative", help="speculative decoding's speed-up per method, workload and stream count",
                   add_help=False)
    sub.add_parser("bench-parallel", help="tensor parallelism's cost or gain here per split, against the planner's "
                   "projection", add_help=False)
    sub.add_parser("bench-precision", help="each pool in its own precision (e.g. bf16 prefill, int4 decode): "
                   "quality on held-out text and speed, against both in bf16", add_help=False)
    sub.add_parser("bench-kv", help="a returning conversation's TTFT with a host KV tier, an urgent prompt's "
                   "with prompts pausing for it, each against the feature off", add_help=False)
    sub.add_parser("bench-crash", help="a decode worker SIGKILLed mid-stream: its streams' gap and completion with "
                   "--durable-kv, with --migrate-on-failure, and with neither", add_help=False)
    sub.add_parser("dashboard", help="write the cluster's Grafana dashboard (JSON)", add_help=False)
    sub.add_parser("top", help="a running cluster in a terminal, from its router's /metrics", add_help=False)
    sub.add_parser("shadow-report", help="the router's comparison of its shadow traffic with the answers it gave",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in OWN_PARSERS:
        return OWN_PARSERS[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
