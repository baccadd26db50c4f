"""The router's background rounds, every second or so: workers whose lease lapsed leave, hot-spot
relief moves running requests off overloaded (or draining) decode workers, the P:D controller
moves a worker between the pools when its rule says so, hot prefixes are copied to more decode
workers, or their copies let go (`replicas.py`), and a canary rollout advances, is promoted or
rolls back (`rollout.py`). A round that fails is logged; the next one runs all the same.

With several routers (`peers.py`), only the leader runs the rounds after the reaping: each acts
once per cluster (relief on every router's streams: a follower moves its own when asked). Each
keeps to one version's workers: relief moves a request only to a worker of its own version (its
KV stays among them); the controller and the prefix copies act on the stable version's."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import httpx

from pdserve import wire
from pdserve.router.peer_state import PeerMove, PeerState, PeerStream, follow_rollout, peers_tallies
from pdserve.router.policy import RunningStream, WorkerLoad, choose_migrations
from pdserve.router.rebalance import ControllerState, PoolMember, decide, new_role, pool_signals, to_move
from pdserve.router.registry import Registry, WorkerEntry
from pdserve.router.router import Router
from pdserve.router.shadow import Shadow

log = logging.getLogger("pdserve.router")


class Rounds:
    """The periodic work, with the state only it keeps: when relief last moved a request off or
    onto each worker, and the P:D controller's memory of its moves and what it last said."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.relieved_at: dict[str, int] = {}  # worker id -> its heartbeat count at its last move
        self.controller = ControllerState()
        self.controller_said: tuple[str, str | None] | None = None  # the last (stage, wanted) it logged

    async def run(self) -> None:
        router = self.router
        while True:
            await asyncio.sleep(min(1.0, router.registry.lease_s / 4))
            router.drop_expired_workers()
            was = router.leading
            await router.peers.look_up()
            await router.peers.probe(router.http, router.worker_headers)
            if router.leading != was:
                log.warning("this router %s for the cluster now (leader: %s)",
                            "acts" if router.leading else "no longer acts", router.peers.leader)
            if (leader := router.peers.leader_state) is not None:
                try:
                    await self.follow(leader)
                except Exception:  # a leader's state this router cannot take: it keeps its own
                    log.exception("following the leader's versions state failed")
            if not router.leading:  # another router acts for the cluster (or this one is still filling up)
                continue
            for name, round_ in (("hot-spot relief", self.relieve_hot_spots), ("rebalance", self.rebalance),
                                 ("hot-prefix replicas", self.copy_hot_prefixes), ("rollout", self.roll_out)):
                try:
                    await round_()
                except Exception:  # a round that fails must not end the reaper
                    log.exception("%s round failed", name)

    async def rebalance(self) -> None:
        """One round of the P:D controller: move one worker between the pools if the rule says so
        (logged with its reason, counted in /metrics), by asking it to change its role."""
        router = self.router
        policy = router.config.rebalance
        if policy is None:
            return
        members = pool_members(router.registry, router.rollout.stable)
        signals = pool_signals(members, router.metrics.recent_ttft.p90(time.perf_counter()))
        decision = decide(signals, policy, self.controller, time.monotonic())
        if (decision.stage, decision.wanted) != self.controller_said:  # each change of mind, not every round
            self.controller_said = (decision.stage, decision.wanted)
            if decision.move is None:
                log.info("rebalance: %s", decision.reason)
        if decision.move is None:
            return
        member, new = to_move(members, decision.move), new_role(decision.move)
        worker = router.registry.get(member.worker_id)
        if worker is None:
            return
        log.info("rebalance: %s %s -> %s: %s", worker.worker_id, worker.role, new, decision.reason)
        router.metrics.rebalances.labels(decision.move).inc()
        try:
            await router.http.post(worker.url + "/v1/role", content=wire.encode(wire.RoleChange(role=new)),
                                   headers=router.worker_headers, timeout=10.0)
        except httpx.HTTPError as e:
            log.warning("rebalance: %s did not take its new role: %s", worker.worker_id, e)

    async def copy_hot_prefixes(self) -> None:
        if self.router.replicas is not None:
            await self.router.replicas.round()

    async def relieve_hot_spots(self) -> None:
        """Move requests off decode workers whose KV use is past the hot threshold, at most one per
        worker per heartbeat it sent (its load is only known again then). The streams of every
        router are candidates: a follower's is moved by asking it to (`peer_state.py`)."""
        router = self.router
        if not router.config.migrate_hot_spots:
            return
        # a worker's load is known afresh only after a heartbeat since it last gave or took a request
        fresh = [w for w in router.registry.workers("decode") if w.heartbeats > self.relieved_at.get(w.worker_id, 0)]
        peers = [(url, stream) for url, state in router.peers.live_states().items() for stream in state.streams]
        for version in {w.version for w in fresh}:  # a request moves among its own version's workers
            decodes = {w.worker_id: w for w in fresh if w.version == version}
            await self._relieve(decodes, peers)

    async def _relieve(self, decodes: dict[str, WorkerEntry], peers: list[tuple[str, PeerStream]]) -> None:
        router = self.router
        streams = [s.running() for s in router.live.values() if s.movable and s.worker_id in decodes]
        by_url = {w.url: k for k, w in decodes.items()}
        followed: dict[str, tuple[str, PeerStream]] = {}  # a follower's stream -> (that router, the stream)
        for peer, ps in peers:
            if (worker_id := by_url.get(ps.worker_url)) is not None and ps.stream_id not in router.live:
                streams.append(RunningStream(ps.stream_id, worker_id, ps.context_tokens, ps.remaining_tokens))
                followed[ps.stream_id] = (peer, ps)
        loads = {k: _as_relief_sees(w) for k, w in decodes.items()}
        moves = choose_migrations(loads, streams, router.config.decode_weights, router.config.relief)
        for stream_id, target in moves:
            live = router.live.get(stream_id)
            if stream_id in followed:
                hot = decodes[by_url[followed[stream_id][1].worker_url]]
            elif live is not None:
                hot = decodes[live.worker_id]
            else:
                continue  # it ended meanwhile
            # moved or not, both wait for their next heartbeat before relief looks at them again
            for entry in (hot, decodes[target]):
                self.relieved_at[entry.worker_id] = entry.heartbeats
            if live is None:
                peer, stream = followed[stream_id]
                await self._ask_peer_to_move(peer, PeerMove(stream.stream_id, stream.worker_url, decodes[target].url))
            else:
                await router.move_stream(live, hot, decodes[target])

    async def _ask_peer_to_move(self, peer: str, move: PeerMove) -> None:
        """The follower `peer` moves a stream of its own, if it still can (it checks)."""
        router = self.router
        try:
            await router.http.post(peer + "/internal/move", content=wire.encode(move), headers=router.worker_headers,
                                   timeout=5.0)
        except httpx.HTTPError as e:
            log.warning("relief: router %s did not move %s: %s", peer, move.stream_id, type(e).__name__)

    async def follow(self, leader: PeerState) -> None:
        """Another router leads: route by its rollout and copy to its shadow, as it does."""
        router = self.router
        follow_rollout(router.rollout, leader.rollout)
        want, shadow = leader.shadow, router.shadow
        have = None if shadow is None else (shadow.version, shadow.share, shadow.max_concurrency, shadow.timeout_s)
        if have == (None if want is None else (want.version, want.share, want.max_concurrency, want.timeout_s)):
            return
        router.shadow = None if want is None else Shadow(router, want.version, want.share, want.max_concurrency,
                                                         want.timeout_s)
        if shadow is not None:
            await shadow.close()
        log.info("shadow traffic as the leader has it: %s", "none" if want is None else
                 f"{100 * want.share:.0f}% to {want.version}")

    async def roll_out(self) -> None:
        """One look at the canary rollout: advance, promote or roll back as its rule says, on the
        outcomes every router of the cluster counted in the step."""
        router = self.router
        rollout = router.rollout
        canary = rollout.canary
        if canary is None:
            return
        peers = peers_tallies(list(router.peers.live_states().values()), rollout)
        happened = rollout.tick(len(router.registry.workers("decode", canary)), peers)
        if happened is None:
            return
        event = rollout.events[-1]
        log.warning("rollout of %s: %s at %.0f%%%s", canary, happened, 100 * event["share"],
                    f": {event['why']}" if "why" in event else "")
        if happened != "advanced":
            router.metrics.rollouts.labels(happened).inc()


def pool_members(registry: Registry, version: str | None = None) -> list[PoolMember]:
    """The workers the P:D controller counts and may move (of `version`; None: every one)."""
    return [PoolMember(w.worker_id, w.role, w.load) for w in registry.workers(version=version)
            if w.role in ("prefill", "decode") and not w.stats.draining]


def _as_relief_sees(worker: WorkerEntry) -> WorkerLoad:
    """A draining worker looks full: its running requests move off it, and none moves onto it."""
    load = worker.load
    return dataclasses.replace(load, kv_blocks_used=load.kv_blocks_total) if worker.stats.draining else load
