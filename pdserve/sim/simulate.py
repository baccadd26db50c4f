"""`pdserve simulate`: a cluster's serving metrics for a workload, without running a model.

1. The performance model: a `pdserve profile` JSON (one for prefill workers and, optionally,
   another for decode and colocated workers, e.g. profiled with their thread counts), or the
   roofline projection of a catalogued model on catalogued GPUs (catalog.py).
2. The workload: the very flags and seeds of `pdserve bench`, so the simulated requests have the
   lengths and arrival times the benchmark sends (give `--vocab-size` of the served model: the
   seeded draws of prompt ids and lengths share one random stream).
3. For each load point, the discrete-event cluster (cluster.py) runs the requests; clients hold at
   most `--concurrency` in flight, as the benchmark does. Summaries are the benchmark's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from pdserve.workload.loadgen import BenchRequest, LengthDist, WorkloadSpec, arrival_times, build_requests
from pdserve.workload.metrics import RequestRecord, summarize
from pdserve.workload.results import write_json
from pdserve.workload.args import add_workload_args, load_points, markdown
from pdserve.router.policy import DisaggregationPolicy
from pdserve.router.rebalance import RebalancePolicy
from pdserve.sim.catalog import GPUS, LINKS, MODELS, fits, roofline
from pdserve.sim.cluster import SimCluster
from pdserve.sim.perf import LinearPerfModel
from pdserve.sim.profile import perf_model


def simulate_point(make_cluster, requests: list[BenchRequest], rate: float, concurrency: int | None,
                   burstiness: float, seed: int) -> list[RequestRecord]:
    """Run one load point; records in request order. Clients send at the arrival times, holding
    back (in arrival order) while `concurrency` requests are in flight; a session's later turn
    goes no earlier than its previous turn's end plus the think time, as `pdserve bench` sends it."""
    cluster: SimCluster = make_cluster()
    offsets = arrival_times(len(requests), rate, burstiness, seed)
    held: list[int] = []
    ids: dict[int, str] = {}
    index_of: dict[str, int] = {}
    in_flight = [0]
    turn_of = {(r.session, r.turn): i for i, r in enumerate(requests) if r.session >= 0}
    ended: set[int] = set()
    waiting_turn: set[int] = set()  # arrived before their previous turn ended

    def send(i: int) -> None:
        in_flight[0] += 1
        r = requests[i]
        prompt = r.prompt if isinstance(r.prompt, list) else list(range(10, 10 + r.prompt_tokens))
        ids[i] = cluster.submit(cluster.clock.now, prompt, r.max_tokens)
        index_of[ids[i]] = i

    def arrive(i: int) -> None:
        r = requests[i]
        before = turn_of.get((r.session, r.turn - 1)) if r.turn else None
        if before is not None and before not in ended:
            waiting_turn.add(i)
        elif concurrency and in_flight[0] >= concurrency:
            held.append(i)
        else:
            send(i)

    def done(request_id: str) -> None:
        in_flight[0] -= 1
        i = index_of[request_id]
        ended.add(i)
        r = requests[i]
        after = turn_of.get((r.session, r.turn + 1)) if r.session >= 0 else None
        if after is not None and after in waiting_turn:  # the user reads the answer, then asks again
            waiting_turn.discard(after)
            cluster.clock.at(cluster.clock.now + requests[after].think_s, lambda: arrive(after))
        if held:
            send(held.pop(0))

    cluster.on_done = done
    for i, t in enumerate(offsets):
        cluster.clock.at(t, lambda i=i: arrive(i))
    cluster.run()
    # a run stopped early (`Clock.stop`) has records only of the requests that arrived before it stopped
    return [cluster.records[ids[i]] for i in range(len(requests)) if ids.get(i) in cluster.records]


def simulate_sweep(make_cluster, spec: WorkloadSpec, points: list[dict], burstiness: float, ttft_slo_s: float,
                   tpot_slo_s: float) -> list[dict]:
    """`pdserve bench`'s sweep, simulated: each point draws its own requests (seed + its index), as
    the benchmark does, and is summarized as the benchmark summarizes."""
    runs = []
    for i, point in enumerate(points):
        requests = build_requests(dataclasses.replace(spec, seed=spec.seed + i))
        records = simulate_point(make_cluster, requests, point["request_rate"], point["concurrency"], burstiness,
                                 spec.seed)
        runs.append({"load": {k: (None if v == math.inf else v) for k, v in point.items()},
                     **summarize(records, ttft_slo_s, tpot_slo_s)})
        print(f"[simulate] {point} done", file=sys.stderr, flush=True)
    return runs


def _num_blocks(args: argparse.Namespace, tp: int) -> int:
    if args.num_blocks is not None:
        return args.num_blocks
    if args.profile:
        return 4096
    return fits(MODELS[args.model_spec], GPUS[args.gpu], tp, args.weight_bits) // 16


def _models(args: argparse.Namespace) -> tuple[LinearPerfModel, LinearPerfModel]:
    """(prefill, decode) performance models: from profiles, or projected by the roofline; the
    decode model speculating where `--draft-acceptance` says so."""
    prefill, decode = _measured_or_projected(args)
    if args.draft_acceptance:
        decode = decode.speculating(args.draft_acceptance, args.num_speculative_tokens)
    return prefill, decode


def _measured_or_projected(args: argparse.Namespace) -> tuple[LinearPerfModel, LinearPerfModel]:
    if args.profile:
        prefill = perf_model(json.loads(Path(args.profile).read_text()), args.backend)
        decode = perf_model(json.loads(Path(args.decode_profile).read_text()), args.backend) if args.decode_profile \
            else prefill
        return prefill, decode
    if not args.gpu:
        raise ValueError("give --profile (measured) or --gpu (projected)")
    try:
        gpu, model, link = GPUS[args.gpu], MODELS[args.model_spec], LINKS[args.link]
    except KeyError as e:
        raise ValueError(f"unknown {e}; see --help for the catalogue") from None
    return (roofline(model, gpu, args.tp_prefill, args.weight_bits, link, fp8_compute=args.fp8_compute),
            roofline(model, gpu, args.tp_decode, args.weight_bits, link, fp8_compute=args.fp8_compute))


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-acceptance", type=float, default=0.0,
                   help="speculative decoding: the chance a draft token is kept after the ones before it were "
                        "(0: no speculation; from a worker's /metrics, a mean accepted length L with k tokens "
                        "drafted solves 1 + a + ... + a^k = L)")
    p.add_argument("--num-speculative-tokens", type=int, default=8, help="draft tokens a step verifies, at most")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=None, help="a `pdserve profile` JSON: the prefill workers' model")
    p.add_argument("--gpu", default=None, help=f"or a roofline projection on one of: {', '.join(GPUS)}")
    p.add_argument("--model-spec", default="llama-3-8b", help=f"the projected model: {', '.join(MODELS)}")
    p.add_argument("--tp-prefill", type=int, default=1)
    p.add_argument("--tp-decode", type=int, default=1)
    p.add_argument("--weight-bits", type=int, default=16, choices=[4, 8, 16])
    p.add_argument("--fp8-compute", action="store_true", help="matmuls at the FP8 peak (8- or 4-bit weights)")
    p.add_argument("--link", default="IB-NDR", help=f"the projected KV link: {', '.join(LINKS)}")
    p.add_argument("--decode-profile", default=None, help="the decode and colocated workers' (default: --profile)")
    p.add_argument("--backend", default=None, help="the profile's link to use (default: its first)")
    add_speculation_args(p)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--colocated", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks of 16 tokens per worker (default: what fits beside the weights when projected, "
                        "else 4096)")
    p.add_argument("--min-remote-tokens", type=int, default=256, help="the router's disaggregation threshold")
    p.add_argument("--rebalance", action="store_true",
                   help="run the router's P:D controller (against --ttft-slo and --tpot-slo): it moves workers "
                        "between the prefill and decode pools as it would live")
    add_workload_args(p)
    p.add_argument("--result-json", default="results/simulate.json")
    args = p.parse_args(argv)
    try:
        prefill_model, decode_model = _models(args)
        spec = WorkloadSpec(args.num_requests, LengthDist.parse(args.input_len), LengthDist.parse(args.output_len),
                            args.seed, args.vocab_size or 1 << 15, args.shared_prefix_len, args.num_prefixes, 1,
                            args.dataset)
        points = load_points(args.request_rate, args.concurrency)
        if not (args.decode or args.colocated):
            raise ValueError("a cluster needs a decode or colocated worker")
    except (OSError, ValueError, KeyError) as e:
        p.error(str(e))
    worker_args = {"num_blocks": _num_blocks(args, args.tp_decode), "max_num_batched_tokens": args.max_num_batched_tokens,
                   "max_num_seqs": args.max_num_seqs}
    prefill_args = {"num_blocks": _num_blocks(args, args.tp_prefill)}
    if not min(worker_args["num_blocks"], prefill_args["num_blocks"] if args.prefill else 1):
        p.error("the model's weights leave no room for KV on those GPUs: raise the tensor parallelism or quantize")

    rebalance = RebalancePolicy(args.ttft_slo / 1e3, args.tpot_slo / 1e3) if args.rebalance else None
    made: list[SimCluster] = []

    def make_cluster() -> SimCluster:
        made.append(SimCluster(prefill_model, decode_model, args.prefill, args.decode, args.colocated, worker_args,
                               DisaggregationPolicy(min_remote_tokens=args.min_remote_tokens), transfer=prefill_model,
                               prefill_worker_args=prefill_args, rebalance=rebalance))
        return made[-1]

    runs = simulate_sweep(make_cluster, spec, points, args.burstiness, args.ttft_slo / 1e3, args.tpot_slo / 1e3)
    if rebalance is not None:
        for run, cluster in zip(runs, made):
            run["moves"] = [{"at_s": round(t, 3), "worker": w, "to": role, "reason": why}
                            for t, w, role, why in cluster.moves]
            run["final_split"] = {"prefill": len(cluster.prefills), "decode": len(cluster.decodes)}
            print(f"[simulate] {run['load']}: {len(cluster.moves)} moves, ending "
                  f"{len(cluster.prefills)}P:{len(cluster.decodes)}D", file=sys.stderr)
    projection = None if args.profile else {
        "gpu": args.gpu, "model": args.model_spec, "tp_prefill": args.tp_prefill, "tp_decode": args.tp_decode,
        "weight_bits": args.weight_bits, "fp8_compute": args.fp8_compute, "link": args.link}
    result = {"settings": {"profile": args.profile, "decode_profile": args.decode_profile, "projection": projection,
                           "prefill": args.prefill, "rebalance": args.rebalance,
                           "decode": args.decode, "colocated": args.colocated, **spec.describe()},
              "runs": runs}
    out = write_json(args.result_json, result)
    print(markdown(runs))
    print(f"wrote {out}", file=sys.stderr)
    return 0

