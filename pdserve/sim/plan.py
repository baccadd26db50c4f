"""Rate matching: the cheapest cluster that serves a traffic profile within its SLA.

The search follows DistServe's observation that the two pools can be sized apart:

1. Capacity per instance. For every instance kind (colocated, prefill, decode), tensor
   parallelism and batch limit, the simulator (cluster.py) finds the highest request rate one
   instance sustains with the SLA's percentile TTFT and TPOT within bounds: a run one request at a
   time first (the best the instance can do at all), then doubling the rate until it fails, then
   bisection. A prefill instance is measured beside a decode instance that costs nothing, and a
   decode instance beside a prefill instance that costs nothing, so each run sees one pool's limit.
2. Sizing. A configuration serving `qps` takes ceil(qps / capacity) instances of each pool;
   its cost is its GPUs, its goodput the lesser pool's capacity times its count.
3. Verification. Candidates are simulated whole, at the demanded rate, cheapest first; one that
   misses a bound gets another instance of the pool that bound belongs to and goes back in line.
   The first that passes is the plan.
4. The Pareto front over every count that fits the GPU budget: for each cost, the most goodput.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from dataclasses import dataclass
from typing import Callable

from pdserve.workload.loadgen import BenchRequest, LengthDist
from pdserve.workload.metrics import RequestRecord
from pdserve.router.policy import DisaggregationPolicy
from pdserve.sim import closed_form
from pdserve.sim.cluster import SimCluster
from pdserve.sim.fork_map import fork_map
from pdserve.sim.perf import LinearPerfModel, StepShape
from pdserve.sim.rate_search import highest_passing_rate
from pdserve.sim.simulate import simulate_point
from pdserve.sim.verdict import SLA, EarlyVerdict, Outcome, percentile

FREE = LinearPerfModel()  # a worker whose steps and transfers take no time
ALL_REMOTE = DisaggregationPolicy(min_remote_tokens=1, saturated_queue_tokens=1 << 62)


@dataclass(frozen=True, slots=True)
class Traffic:
    isl: LengthDist
    osl: LengthDist
    qps: float


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One instance of `tp` GPUs: its step model and the KV tokens it holds."""

    perf: LinearPerfModel
    kv_tokens: int


InstanceFactory = Callable[[int], "InstanceSpec | None"]  # tp -> the instance, None if the model does not fit


@dataclass(frozen=True, slots=True)
class Capacity:
    kind: str  # colocated | prefill | decode
    tp: int
    batch: int  # max sequences per step (0 for a prefill instance: it batches what its token budget holds)
    rate: float  # requests/s one instance sustains within the SLA; 0 if none
    lone: Outcome  # one request at a time: the best it can do

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Capacity:
        return cls(d["kind"], d["tp"], d["batch"], d["rate"], Outcome(**d["lone"]))


@dataclass(frozen=True, slots=True)
class Config:
    num_gpus: int
    goodput: float  # estimated from the pools' capacities, req/s
    mode: str  # colocated | disaggregated
    num_prefill: int  # colocated: the replicas
    tp_prefill: int
    num_decode: int
    tp_decode: int
    batch: int  # max sequences per decode (or colocated) step

    def describe(self) -> str:
        if self.mode == "colocated":
            return f"colocated {self.num_prefill} x TP{self.tp_prefill} (batch {self.batch})"
        return (f"disaggregated {self.num_prefill}P x TP{self.tp_prefill} + {self.num_decode}D x TP{self.tp_decode} "
                f"(batch {self.batch})")

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["goodput_per_gpu"] = self.goodput / self.num_gpus
        if self.mode == "colocated":
            out.update(num_decode=0, tp_decode=0)
        return out


class Planner:
    def __init__(self, instances: InstanceFactory, traffic: Traffic, sla: SLA, tps=(1, 2, 4, 8),
                 batches=(16, 64, 256), max_gpus: int = 16, chunk_tokens: int = 2048, num_requests: int = 400,
                 seed: int = 0, tolerance: float = 0.05, progress: Callable[[str], None] = lambda line: None) -> None:
        self.instances, self.traffic, self.sla = instances, traffic, sla
        self.tps = [tp for tp in tps if tp <= max_gpus and instances(tp) is not None]
        self.batches, self.max_gpus, self.chunk_tokens = list(batches), max_gpus, chunk_tokens
        self.num_requests, self.seed, self.tolerance, self.progress = num_requests, seed, tolerance, progress
        self._requests: dict[LengthDist, list[BenchRequest]] = {}
        self.capacities: list[Capacity] = []
        self._lone_outcomes: dict[tuple[str, int], Outcome] = {}

    # -- simulation ------------------------------------------------------------------------------

    def _workload(self, n: int, output_len: LengthDist | None = None) -> list[BenchRequest]:
        """The first `n` requests of one seeded sequence: lengths from the traffic, prompts that share
        no prefix (their first tokens differ), so the simulated clusters cache no prefixes."""
        osl = output_len or self.traffic.osl
        have = self._requests.setdefault(osl, [])
        if len(have) < n:
            rng = random.Random(self.seed)
            have[:] = [BenchRequest([10 + i % 30000, 10 + i // 30000] + [5] * max(0, self.traffic.isl.sample(rng) - 2),
                                    osl.sample(rng)) for i in range(max(n, 2 * len(have)))]
        return have[:n]

    def run_length(self, rate: float) -> int:
        """Requests per run at `rate`: enough that an overload of a few percent piles up a queue
        longer than the TTFT bound before the run ends (an overload by a share x adds about
        n * x / rate seconds of queue by the last arrival), and percentiles that bursts of a short
        run do not sway."""
        return min(max(self.num_requests, math.ceil(40 * self.sla.ttft_s * rate)), 4000)

    def _worker_args(self, spec: InstanceSpec, batch: int = 0) -> dict:
        return {"num_blocks": spec.kv_tokens // 16, "max_num_seqs": batch or max(self.batches),
                "max_num_batched_tokens": self.chunk_tokens}

    def run(self, cluster: Callable[[], SimCluster], rate: float, concurrency: int | None = None,
            n: int | None = None, output_len: LengthDist | None = None, sla: SLA | None = None,
            stop_on: tuple[str, ...] = ("ttft", "tpot")) -> Outcome:
        """One simulated run of the seeded workload at `rate`, ended as soon as it is certain to
        miss a bound of `stop_on` in `sla` (the plan's by default)."""
        requests = self._workload(n or self.num_requests, output_len)
        verdict = EarlyVerdict(sla or self.sla, requests, stop_on)
        records = simulate_point(lambda: verdict.watch(cluster()), requests, rate, concurrency, 1.0, self.seed)
        return self._outcome(records, verdict.missed)

    def _outcome(self, records: list[RequestRecord], missed: list[str] = ()) -> Outcome:
        done = [r for r in records if r.ok]
        tpots = [t for r in done if (t := r.tpot) is not None]
        ttft = math.inf if "ttft" in missed else percentile([r.ttft for r in done], self.sla.percentile)
        tpot = math.inf if "tpot" in missed else percentile(tpots, self.sla.percentile)
        if missed:
            return Outcome(ttft, tpot, True, stopped_early=True)
        return Outcome(ttft, tpot, len(done) == len(records))

    def _lone(self, kind: str, spec: InstanceSpec, output_len: LengthDist | None) -> Outcome:
        """One request at a time. Alone, a request's times depend on its lengths only (and the
        batch limit plays no part), so each distinct pair of lengths runs once, one after another
        on one instance, and counts as often as the workload has it."""
        requests = self._workload(self.num_requests, output_len)
        distinct = list({(r.prompt_tokens, r.max_tokens): r for r in requests}.values())
        make = self._instance_cluster(kind, spec, max(self.batches), self.num_requests, 0.0)
        alone = dict(zip(((r.prompt_tokens, r.max_tokens) for r in distinct),
                         simulate_point(make, distinct, math.inf, 1, 1.0, self.seed)))
        return self._outcome([alone[(r.prompt_tokens, r.max_tokens)] for r in requests])

    def cluster(self, config: Config) -> Callable[[], SimCluster]:
        p, d = self.instances(config.tp_prefill), self.instances(config.tp_decode or config.tp_prefill)
        if config.mode == "colocated":
            return lambda: SimCluster(p.perf, p.perf, num_colocated=config.num_prefill,
                                      worker_args=self._worker_args(p, config.batch), prefix_caching=False)
        return lambda: SimCluster(p.perf, d.perf, config.num_prefill, config.num_decode,
                                  worker_args=self._worker_args(d, config.batch), policy=ALL_REMOTE,
                                  transfer=p.perf, prefill_worker_args=self._worker_args(p), prefix_caching=False)

    def _instance_cluster(self, kind: str, spec: InstanceSpec, batch: int, n: int,
                          rate: float) -> Callable[[], SimCluster]:
        if kind == "colocated":
            return lambda: SimCluster(spec.perf, spec.perf, num_colocated=1, worker_args=self._worker_args(spec, batch),
                                      prefix_caching=False)
        longest = max(r.prompt_tokens + r.max_tokens for r in self._workload(n))
        if kind == "prefill":  # beside a decode instance that costs nothing
            # It reserves KV for every prompt queued on the prefill instance, so it holds the
            # prompts a run within the SLA can have waiting at once (more would only wait in a run
            # that misses the TTFT bound anyway; a larger pool only costs time to build).
            held = min(n, math.ceil(4 * rate * self.sla.ttft_s) + 64)
            free = {"num_blocks": held * (longest // 16 + 2), "max_num_seqs": held, "max_num_batched_tokens": 1 << 30}
            return lambda: SimCluster(spec.perf, FREE, 1, 1, worker_args=free, policy=ALL_REMOTE, transfer=spec.perf,
                                      prefill_worker_args=self._worker_args(spec, batch), prefix_caching=False)
        # Beside a prefill instance that costs nothing: it computes each prompt the moment the
        # decode instance reserved for it, in no time, so room for a few prompts is all it needs.
        free = {"num_blocks": 4 * (longest // 16 + 2), "max_num_seqs": 4, "max_num_batched_tokens": 1 << 30}
        return lambda: SimCluster(FREE, spec.perf, 1, 1, worker_args=self._worker_args(spec, batch),
                                  policy=ALL_REMOTE, transfer=FREE, prefill_worker_args=free, prefix_caching=False)

    # -- 1. capacity per instance ------------------------------------------------------------------

    def capacity(self, kind: str, tp: int, batch: int) -> Capacity:
        spec = self.instances(tp)
        output_len = LengthDist("fixed", 1) if kind == "prefill" else None  # TTFT is all a prefill pool sets
        sla = self.sla if kind != "prefill" else dataclasses.replace(self.sla, tpot_s=math.inf)

        # a batch holds no more sequences than the KV cache does, whatever its limit
        fits = spec.kv_tokens // max(1, round(self.traffic.isl.mean + self.traffic.osl.mean))

        def ok(rate: float) -> Outcome:
            # enough requests to fill the batch three times over: an overload must show within the run
            n = max(self.run_length(rate), 3 * min(batch, fits))
            return self.run(self._instance_cluster(kind, spec, batch, n, rate), rate, n=n, output_len=output_len,
                            sla=sla)

        # one request at a time: the batch limit plays no part
        key = (kind, tp)
        if key not in self._lone_outcomes:
            self._lone_outcomes[key] = self._lone(kind, spec, output_len)
        lone = self._lone_outcomes[key]
        if lone.misses(sla):
            return Capacity(kind, tp, batch, 0.0, lone)
        guess, informed = self._guess(kind, tp, batch)
        rate = highest_passing_rate(lambda r: not ok(r).misses(sla), guess, self.tolerance, informed)
        return Capacity(kind, tp, batch, rate, lone)

    def _guess(self, kind: str, tp: int, batch: int) -> tuple[float, bool]:
        """Where to start a capacity search, and whether the start is informed (near the answer):
        for a prefill or decode instance its closed form (closed_form.py), corrected by how far off
        it was for the same instance with the nearest batch limit when that was measured; for a
        colocated one the answer with the nearest batch limit; else the optimistic bound."""
        estimate = self._closed_form(kind, tp, batch)
        measured = [c for c in self.capacities if c.kind == kind and c.tp == tp and c.rate > 0]
        if measured:
            near = min(measured, key=lambda c: abs(math.log((c.batch or 1) / (batch or 1))))
            near_estimate = self._closed_form(kind, tp, near.batch)
            estimate = estimate * near.rate / near_estimate if estimate and near_estimate else near.rate
        if 0 < estimate < math.inf:
            return estimate, True
        return self._first_guess(kind, self.instances(tp), batch), False

    def _closed_form(self, kind: str, tp: int, batch: int) -> float:
        """The closed-form capacity of a prefill or decode instance; 0 for a colocated one."""
        spec = self.instances(tp)
        isl, osl = max(1, round(self.traffic.isl.mean)), max(1, round(self.traffic.osl.mean))
        if kind == "prefill":
            return closed_form.prefill_rate(spec.perf, isl, self.chunk_tokens, self.sla.ttft_s, self.sla.percentile)
        if kind == "decode":
            return closed_form.decode_rate(spec.perf, isl, osl, self.sla.tpot_s, batch, spec.kv_tokens)
        return 0.0

    def _first_guess(self, kind: str, spec: InstanceSpec, batch: int) -> float:
        """Requests/s of a perfectly batched instance: an optimistic start for the search."""
        isl, osl = max(1, round(self.traffic.isl.mean)), max(1, round(self.traffic.osl.mean))
        prefill = spec.perf.step_time(StepShape(prefill_tokens=isl, prefill_context=isl // 2))
        b = batch or 1
        decode = spec.perf.step_time(StepShape(decode_seqs=b, decode_context=b * (isl + osl // 2))) / b
        per_request = {"prefill": prefill, "decode": decode * osl, "colocated": prefill + decode * osl}[kind]
        return max(1.0 / per_request, 1e-3)

    def measure(self, workers: int | None = None, keys: list[tuple[str, int, int]] | None = None) -> list[Capacity]:
        """The capacity of every instance (kind, TP, batch limit), or of those in `keys`. Each kind
        and TP is a chain of searches, batch limit by batch limit (a colocated search starts from
        its neighbour's answer); the chains run in parallel, one per core, the costliest first
        (colocated, then decode, the larger TP first: more requests fit within the SLA there, so
        its runs are longer)."""
        kinds = (("colocated", self.batches), ("decode", self.batches), ("prefill", [0]))
        wanted = keys or [(kind, tp, b) for tp in self.tps for kind, batches in (kinds[0], kinds[2], kinds[1])
                          for b in batches]
        chains = [chain for tp in sorted(self.tps, reverse=True) for kind, batches in kinds
                  if (chain := [(kind, tp, b) for b in batches if (kind, tp, b) in wanted])]
        done = fork_map(self._measure_chain, chains, workers)
        by_key = {(c.kind, c.tp, c.batch): c for chain in done for c in map(Capacity.from_json, chain)}
        self.capacities += [by_key[key] for key in wanted]
        return self.capacities

    def _measure_chain(self, chain: list[tuple[str, int, int]]) -> list[dict]:
        for kind, tp, batch in chain:
            cap = self.capacity(kind, tp, batch)
            self.capacities.append(cap)
            self.progress(f"{kind:9} TP{tp} batch {batch if kind != 'prefill' else '-':>4}: {cap.rate:.3g} req/s")
        return [c.to_json() for c in self.capacities if (c.kind, c.tp, c.batch) in chain]

    def rates(self) -> dict[tuple[str, int, int], float]:
        """(kind, tp, batch) -> the measured capacity, req/s."""
        return {(c.kind, c.tp, c.batch): c.rate for c in self.capacities}

    # -- 2. sizing and the Pareto front ------------------------------------------------------------

    def configs(self, qps: float | None = None) -> list[Config]:
        """Every configuration within the GPU budget: sized for `qps`, or every count if None."""
        cap = self.rates()
        out: list[Config] = []
        for (kind, tp, batch), rate in cap.items():
            if kind != "colocated" or not rate:
                continue
            counts = [math.ceil(qps / rate)] if qps else range(1, self.max_gpus // tp + 1)
            out += [Config(n * tp, n * rate, "colocated", n, tp, 0, 0, batch) for n in counts if n * tp <= self.max_gpus]
        for tp_p in self.tps:
            p_rate = cap.get(("prefill", tp_p, 0), 0.0)
            for (kind, tp_d, batch), d_rate in cap.items():
                if kind != "decode" or not (p_rate and d_rate):
                    continue
                if qps:
                    pairs = [(math.ceil(qps / p_rate), math.ceil(qps / d_rate))]
                else:
                    pairs = [(p, d) for p in range(1, self.max_gpus // tp_p + 1)
                             for d in range(1, (self.max_gpus - p * tp_p) // tp_d + 1)]
                out += [Config(p * tp_p + d * tp_d, min(p * p_rate, d * d_rate), "disaggregated", p, tp_p, d, tp_d,
                               batch) for p, d in pairs if p * tp_p + d * tp_d <= self.max_gpus]
        return out

    def pareto(self, mode: str | None = None) -> list[Config]:
        """For each GPU count, the configuration (of `mode`, or either) with the most goodput, where
        that beats every cheaper one."""
        front: list[Config] = []
        for c in sorted((c for c in self.configs() if mode in (None, c.mode)), key=lambda c: (c.num_gpus, -c.goodput)):
            if not front or c.goodput > front[-1].goodput * (1 + 1e-9):
                if front and front[-1].num_gpus == c.num_gpus:
                    continue
                front.append(c)
        return front

    # -- 3. verification -----------------------------------------------------------------------------

    def verify(self, config: Config, rate: float | None = None, stop_on: tuple[str, ...] = ("ttft", "tpot")) -> Outcome:
        instances = config.num_prefill + config.num_decode
        rate = rate or self.traffic.qps
        n = max(self.num_requests * min(4, max(1, instances)), self.run_length(rate))
        return self.run(self.cluster(config), rate, n=n, stop_on=stop_on)

    def best(self, mode: str | None = None, max_tries: int = 32) -> tuple[Config, Outcome] | None:
        """The cheapest configuration (of `mode`, or either) whose whole-cluster simulation meets the
        SLA at the demanded rate."""
        order = itertools.count()  # ties go in the order candidates joined the line
        line = [(c.num_gpus, -c.goodput, next(order), c) for c in self.configs(self.traffic.qps)
                if mode in (None, c.mode)]
        heapq.heapify(line)
        tried: set[tuple] = set()
        while line and len(tried) < max_tries:
            *_, config = heapq.heappop(line)
            shape = dataclasses.astuple(config)[2:]  # the same cluster, whatever its estimate
            if shape in tried:
                continue
            tried.add(shape)
            # stopped early for TTFT only: a run that misses both bounds grows the prefill pool
            outcome = self.verify(config, stop_on=("ttft",))
            missed = outcome.misses(self.sla)
            self.progress(f"verify {config.describe()}: " + (f"misses {', '.join(missed)}" if missed else "meets the SLA"))
            if not missed:
                return config, outcome
            bigger = self._grow(config, missed)
            if bigger.num_gpus <= self.max_gpus:
                heapq.heappush(line, (bigger.num_gpus, -bigger.goodput, next(order), bigger))
        return None

    @staticmethod
    def _grow(c: Config, missed: list[str]) -> Config:
        if c.mode == "colocated":
            return dataclasses.replace(c, num_gpus=c.num_gpus + c.tp_prefill, num_prefill=c.num_prefill + 1)
        if "ttft" in missed:
            return dataclasses.replace(c, num_gpus=c.num_gpus + c.tp_prefill, num_prefill=c.num_prefill + 1)
        return dataclasses.replace(c, num_gpus=c.num_gpus + c.tp_decode, num_decode=c.num_decode + 1)

    def goodput(self, config: Config, ceiling: float) -> float:
        """The highest rate (within `tolerance`) at which the whole cluster meets the SLA, from the
        demanded rate up to `ceiling`."""
        lo, hi = self.traffic.qps, max(ceiling, self.traffic.qps) * (1 + self.tolerance)
        while hi / lo > 1 + self.tolerance:
            mid = (lo + hi) / 2
            if self.verify(config, mid).misses(self.sla):
                hi = mid
            else:
                lo = mid
        return lo


def within_budget(configs: list[Config], gpus: int, one_to_one: bool = False) -> Config | None:
    """The disaggregated configuration with the most goodput on at most `gpus` GPUs; with
    `one_to_one`, only those with as many prefill as decode instances, of one TP."""
    fit = [c for c in configs if c.mode == "disaggregated" and c.num_gpus <= gpus
           and (not one_to_one or (c.num_prefill == c.num_decode and c.tp_prefill == c.tp_decode))]
    return max(fit, key=lambda c: (c.goodput, -c.num_gpus), default=None)


def unreachable(capacities: list[Capacity], sla: SLA) -> list[str]:
    """Why no instance meets the SLA even alone: each bound out of reach, with the best value any
    instance reaches one request at a time."""
    reasons = []
    for bound, kinds, limit in (("TTFT", ("colocated", "prefill"), sla.ttft_s), ("TPOT", ("colocated", "decode"),
                                                                             sla.tpot_s)):
        options = [c for c in capacities if c.kind in kinds]
        value = (lambda c: c.lone.ttft_s) if bound == "TTFT" else (lambda c: c.lone.tpot_s)
        top = min(options, key=value, default=None)
        if top is not None and value(top) > limit:
            reasons.append(f"p{sla.percentile:g} {bound} <= {limit * 1e3:g} ms is out of reach: the best any instance "
                           f"does, one request at a time, is {value(top) * 1e3:.1f} ms ({top.kind}, TP{top.tp})")
    return reasons
