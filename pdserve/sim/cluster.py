"""A discrete-event simulation of a pdserve cluster. The router's policies (router/policy.py) and
the engine's scheduler (engine/scheduler.py) are the very code that serves; here a clock drives
them instead of a model, and a performance model says how long each step and transfer takes.

Lifecycle of a simulated request:
1. Arrival: the router's routing function (router/routing.py) chooses a decode worker and, when
   the uncached prompt is long enough and the prefill pool not saturated, a prefill worker.
2. Colocated: the decode worker's scheduler admits it and computes the prompt in chunks; the step
   that completes the prompt samples the first token.
3. Disaggregated: the decode worker's scheduler reserves blocks (`on_reserved`), the prefill worker
   computes the prompt and samples the first token, the KV transfer's exposed time passes, and the
   decode worker's scheduler takes it (`kv_landed`).
4. Each decode step adds a token, until max_tokens (EOS is ignored). Every token's time is kept,
   and the records are the ones `pdserve bench` summarizes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Callable

from pdserve.workload.metrics import RequestRecord
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request
from pdserve.engine.role import RoleHooks
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.step import SchedulerOutput
from pdserve.router.policy import DecodeWeights, DisaggregationPolicy, PrefixIndex, WorkerLoad
from pdserve.router.rebalance import (
    ControllerState, PoolMember, RebalancePolicy, RecentTTFT, decide, new_role, pool_signals, to_move,
)
from pdserve.router.routing import Candidate, route
from pdserve.sampling_params import SamplingParams
from pdserve.engine.step_shape import StepShape, step_shape
from pdserve.sim.perf import LinearPerfModel

TOKEN = 7  # what every simulated step samples
_PREFILL_SUFFIX = "@prefill"


class Clock:
    """Events in time order; ties in the order they were scheduled."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._stopped = False

    def stop(self) -> None:
        """End the run now: events still pending never happen."""
        self._stopped = True

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (max(t, self.now), next(self._seq), fn))

    def run(self) -> None:
        while self._events and not self._stopped:
            self.now, _, fn = heapq.heappop(self._events)
            fn()

    @property
    def pending(self) -> int:
        return len(self._events)

    @property
    def next_time(self) -> float:
        """When the next event is due; infinity with none."""
        return self._events[0][0] if self._events else math.inf


class SimWorker(RoleHooks):
    """One worker: the real scheduler and block manager, stepped by the clock."""

    def __init__(self, cluster: SimCluster, name: str, role: str, perf: LinearPerfModel, num_blocks: int,
                 block_size: int = 16, max_num_batched_tokens: int = 512, max_num_seqs: int = 64,
                 headroom_tokens: int = 64, prefix_caching: bool = True) -> None:
        self.cluster, self.name, self.role, self.perf = cluster, name, role, perf
        self.scheduler = Scheduler(BlockManager(num_blocks, block_size, prefix_caching), max_num_batched_tokens,
                                   max_num_seqs, hooks=self, headroom_tokens=headroom_tokens)
        self.busy = False
        self.step_ewma_s = 0.0
        self.num_steps = 0
        self.busy_s = 0.0
        self.routed: dict[str, int] = {}  # prompts routed here, not yet in its scheduler: request id -> tokens
        self.moving_to: str | None = None  # the P:D controller moves it: it drains, then takes this role

    @property
    def idle(self) -> bool:
        return not (self.busy or self.routed or self.scheduler.has_unfinished())

    def load(self) -> WorkerLoad:
        """What the router would see: the scheduler now, plus the prompts routed here that its
        scheduler has not been given yet, each waiting with its tokens queued."""
        s, b = self.scheduler, self.scheduler.blocks
        return WorkerLoad(len(s.running), len(s.waiting) + len(self.routed), len(s.waiting_for_kv),
                          s.queued_prefill_tokens + sum(self.routed.values()),
                          b.num_blocks - b.num_free_blocks, b.num_blocks, self.step_ewma_s * 1e3,
                          step_token_budget=s.max_num_batched_tokens)

    def candidate(self) -> Candidate:
        # every simulated queue is unbounded: each worker always has room
        return Candidate(self.name, self.role, self.load(), has_room=True, block_size=self.scheduler.blocks.block_size)

    def kick(self) -> None:
        if self.busy:
            return
        out = self.scheduler.schedule()
        if out.empty:
            return
        shape = step_shape(out)
        durations = self._repeats(out, shape) or [self.perf.step_time(shape)]
        self.busy = True
        start = end = self.cluster.clock.now
        for d in durations:  # added one by one, as step after step would (the same float rounding)
            end += d
        self.cluster.clock.at(end, lambda: self._finish(out, durations, start))

    def _repeats(self, out: SchedulerOutput, shape: StepShape) -> list[float] | None:
        """The durations of the decode steps that will follow this one unchanged, when there are
        some: every running sequence decodes, nothing can be admitted, no sequence ends before
        the last of them, the blocks they need are free, and nothing else happens in the cluster
        until they are done. Those steps are then one event (`_finish` applies them as the
        scheduler would, one by one) instead of one event and one schedule each.

        Only without prefix caching: which block a sequence gets then changes nothing else, so
        the blocks of all those steps can be taken at their end (with prefix caching, the order
        blocks are taken in decides which cached prefixes are evicted)."""
        s, blocks = self.scheduler, self.scheduler.blocks
        if blocks.enable_prefix_caching or not self.cluster.repeat_steps or out.preempted \
                or out.num_decodes != len(out.requests) or len(out.requests) != len(s.running) \
                or (s.waiting and s.num_live < s.max_num_seqs):
            return None
        if any(not r.output_token_ids for r in out.requests):  # a prompt's last token, not a decode
            return None
        steps = min(r.max_total_tokens - r.num_tokens for r in out.requests)  # the last one may end some
        if steps < 3:
            return None
        free_until = self.cluster.clock.next_time - self.cluster.clock.now
        durations, elapsed, b = [], 0.0, shape.decode_seqs
        for i in range(steps):
            d = self.perf.step_time(StepShape(decode_seqs=b, decode_context=shape.decode_context + i * b))
            if elapsed + d >= free_until:
                break
            durations.append(d)
            elapsed += d
        while len(durations) >= 3 and self._blocks_for(out, len(durations)) > blocks.num_free_blocks:
            del durations[len(durations) // 2:]
        return durations if len(durations) >= 3 else None

    def _blocks_for(self, out: SchedulerOutput, steps: int) -> int:
        """New blocks `steps` decode steps take beyond what the first one allocated."""
        b = self.scheduler.blocks
        return sum(b.blocks_needed(r.num_computed_tokens + steps) - len(b.block_table(r.request_id))
                   for r in out.requests)

    def _finish(self, out: SchedulerOutput, durations: list[float], start: float) -> None:
        if len(durations) > 1:
            self._apply_repeats(out, durations[:-1], start)
        for duration in durations:
            self.num_steps += 1
            self.busy_s += duration
            self.step_ewma_s = duration if self.num_steps == 1 else 0.8 * self.step_ewma_s + 0.2 * duration
        sampled = [TOKEN if r.num_computed_tokens + n == r.num_tokens else None
                   for r, n in zip(out.requests, out.num_new_tokens)]
        for req in self.scheduler.update(out, sampled):
            self.cluster.token(req)
        self.busy = False
        self.kick()

    def _apply_repeats(self, out: SchedulerOutput, durations: list[float], start: float) -> None:
        """Every step but the last of a run of repeated decode steps (`_repeats`), as the
        scheduler's update and the next schedule would have made them: a token for every
        sequence at each step's end, and the blocks the last step needs."""
        k = len(durations)
        ends = list(itertools.accumulate(durations, initial=start))[1:]
        for req in out.requests:
            req.num_computed_tokens += k
            req.output_token_ids.extend([TOKEN] * k)
        for req in out.requests:
            if not self.scheduler.blocks.allocate(req, 1):
                raise RuntimeError("a repeated decode step found fewer free blocks than counted")
            self.cluster.tokens(req, ends)

    # scheduler hooks
    def on_reserved(self, request: Request) -> None:
        self.cluster.dispatch_prefill(self, request)

    def on_finished(self, request: Request) -> None:
        self.cluster.finished(self, request)


class SimCluster:
    def __init__(self, prefill_perf: LinearPerfModel, decode_perf: LinearPerfModel, num_prefill: int = 0,
                 num_decode: int = 0, num_colocated: int = 0, worker_args: dict | None = None,
                 policy: DisaggregationPolicy = DisaggregationPolicy(), weights: DecodeWeights = DecodeWeights(),
                 transfer: LinearPerfModel | None = None, prefill_worker_args: dict | None = None,
                 rebalance: RebalancePolicy | None = None, rebalance_every_s: float = 1.0,
                 prefix_caching: bool = True, repeat_steps: bool = True) -> None:
        """`prefix_caching` False: no worker caches prefixes and the router hashes no prompt, for
        workloads whose prompts share none (the result is the same, sooner); decode steps that
        repeat unchanged are then taken as one event (`repeat_steps`, SimWorker._repeats)."""
        if not (num_decode or num_colocated):
            raise ValueError("a simulated cluster needs a decode or colocated worker")
        self.clock = Clock()
        args = {"num_blocks": 4096, "prefix_caching": prefix_caching, **(worker_args or {})}
        p_args = {**args, **(prefill_worker_args or {})}
        self.prefills = [SimWorker(self, f"prefill{i}", "prefill", prefill_perf, **p_args) for i in range(num_prefill)]
        self.decodes = [SimWorker(self, f"decode{i}", "decode", decode_perf, **args) for i in range(num_decode)]
        self.decodes += [SimWorker(self, f"both{i}", "both", decode_perf, **args) for i in range(num_colocated)]
        self.policy, self.weights = policy, weights
        self.transfer = transfer or decode_perf
        self.index = PrefixIndex() if prefix_caching else None
        self.repeat_steps = repeat_steps
        self.records: dict[str, RequestRecord] = {}
        self._targets: dict[str, SimWorker] = {}  # decode request id -> its prefill worker
        self._waiting_kv: dict[str, tuple[SimWorker, Request]] = {}  # prefill request id -> decode side
        self._ids = itertools.count()
        self.on_done: Callable[[str], None] = lambda request_id: None  # a client's request completed
        self.observe: Callable[[RequestRecord, str], None] = lambda record, event: None  # "first_token", "done"
        self.perf = {"prefill": prefill_perf, "decode": decode_perf}
        self.rebalance, self.rebalance_every_s = rebalance, rebalance_every_s
        self.controller = ControllerState()
        self.recent_ttft = RecentTTFT()
        self.moves: list[tuple[float, str, str, str]] = []  # (time, worker, new role, reason)
        self.splits: list[tuple[float, int, int]] = []  # (time, prefill, decode workers serving) at each change
        self._note_split()
        self._ticking = False

    # -- the router ------------------------------------------------------------------------------

    def submit(self, at: float, prompt: list[int], max_tokens: int) -> str:
        request_id = f"r{next(self._ids)}"
        self.clock.at(at, lambda: self._arrive(request_id, prompt, max_tokens))
        return request_id

    def _arrive(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        """Route as the router does, with loads read at this instant: a decode worker's scheduler
        holds the request from now on, while a prefill worker's is given it only once the decode
        worker has reserved its blocks, so until then the prefill worker counts it as routed."""
        if self.rebalance is not None and not self._ticking:
            self._ticking = True
            self.clock.at(self.clock.now, self._control)
        workers = {w.name: w for w in self.prefills + self.decodes if w.moving_to is None}
        decision = route([w.candidate() for w in workers.values()], prompt, self.index, self.weights, self.policy)
        for r in decision.records:  # none without an index
            self.index.record(r.worker_id, r.block_size, r.hashes)
        d = workers[decision.decode_id]
        remote = decision.prefill_id is not None
        if remote:
            p = workers[decision.prefill_id]
            p.routed[request_id] = decision.prefill_uncached
            self._targets[request_id] = p
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        req = Request(request_id, prompt, params, len(prompt) + max_tokens, arrival_time=self.clock.now,
                      remote_prefill=remote)
        self.records[request_id] = RequestRecord(start=self.clock.now, prompt_tokens=len(prompt))
        d.scheduler.add(req)
        d.kick()

    # -- the P:D controller, the router's very rule (router/rebalance.py) ---------------------------

    def _control(self) -> None:
        """A round of the controller; a worker being moved takes its new role once it drained (it
        is routed nothing meanwhile), with the performance model of that role's workers."""
        for w in self.prefills + self.decodes:
            if w.moving_to is not None and w.idle:
                (self.prefills if w.role == "prefill" else self.decodes).remove(w)
                w.role, w.perf, w.moving_to = w.moving_to, self.perf[w.moving_to], None
                (self.prefills if w.role == "prefill" else self.decodes).append(w)
                self._note_split()
        members = [PoolMember(w.name, w.role, w.load()) for w in self.prefills + self.decodes
                   if w.role in ("prefill", "decode") and w.moving_to is None]
        signals = pool_signals(members, self.recent_ttft.p90(self.clock.now))
        decision = decide(signals, self.rebalance, self.controller, self.clock.now)
        if decision.move is not None:
            name = to_move(members, decision.move).worker_id
            worker = next(w for w in self.prefills + self.decodes if w.name == name)
            worker.moving_to = new_role(decision.move)
            self.moves.append((self.clock.now, name, worker.moving_to, decision.reason))
            self._note_split()
        if self.clock.pending:  # anything else still to happen: the controller keeps watching
            self.clock.at(self.clock.now + self.rebalance_every_s, self._control)
        else:
            self._ticking = False

    def _note_split(self) -> None:
        """The pools as the router sees them now: a worker that drains serves neither."""
        serving = [w.role for w in self.prefills + self.decodes if w.moving_to is None]
        self.splits.append((self.clock.now, serving.count("prefill"), serving.count("decode")))

    # -- between workers ---------------------------------------------------------------------------

    def dispatch_prefill(self, decode: SimWorker, req: Request) -> None:
        p = self._targets.pop(req.request_id)
        del p.routed[req.request_id]
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        prefill_req = Request(req.request_id + _PREFILL_SUFFIX, req.prompt_token_ids, params, req.num_tokens + 1,
                              arrival_time=self.clock.now)
        self._waiting_kv[prefill_req.request_id] = (decode, req)
        p.scheduler.add(prefill_req)
        self.clock.at(self.clock.now, p.kick)  # after the decode step that reserved it

    def finished(self, worker: SimWorker, req: Request) -> None:
        if req.request_id.endswith(_PREFILL_SUFFIX):
            decode, decode_req = self._waiting_kv.pop(req.request_id)
            missing = decode_req.num_tokens - decode_req.num_computed_tokens
            self.clock.at(self.clock.now + self.transfer.transfer_time(missing), lambda: self._land(decode, decode_req))
            return
        self.records[req.request_id].end = self.clock.now
        self.on_done(req.request_id)

    def _land(self, decode: SimWorker, req: Request) -> None:
        record = self.records[req.request_id]
        if decode.scheduler.kv_landed(req.request_id, TOKEN) is not None:
            self._tokens_arrived(record)
        decode.kick()

    def token(self, req: Request) -> None:
        if not req.request_id.endswith(_PREFILL_SUFFIX):
            record = self.records[req.request_id]
            self._tokens_arrived(record)
            if req.status.finished:  # its last token: the request is done, with all its tokens counted
                self.observe(record, "done")

    def tokens(self, req: Request, times: list[float]) -> None:
        """Tokens of a running request's repeated decode steps, one at each of `times` (none is
        its first or its last)."""
        if not req.request_id.endswith(_PREFILL_SUFFIX):
            record = self.records[req.request_id]
            record.chunk_times.extend(times)
            record.output_tokens += len(times)

    def _tokens_arrived(self, record: RequestRecord) -> None:
        now = self.clock.now
        if record.first_token is None:
            record.first_token = now
            self.recent_ttft.add(now, now - record.start)
            self.observe(record, "first_token")
        record.chunk_times.append(now)
        record.output_tokens += 1

    # -- running -----------------------------------------------------------------------------------

    def run(self) -> list[RequestRecord]:
        self.clock.run()
        return list(self.records.values())
