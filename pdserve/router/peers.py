"""Router replicas: which of a cluster's routers acts for all of them.

Several routers serve one cluster; each worker registers and heartbeats with every one, so each
has the whole membership and every worker's load (`pdserve worker --router URL,URL`). What must
happen once per cluster — the P:D controller's moves, hot-spot relief, hot-prefix copies, a canary
rollout's steps — is done by one of them, the leader:

1. Each router knows the others' internal addresses (`--peers`, or a dns+ name standing for all
   of them, looked up again every few seconds: `router_addresses.py`) and asks each for its state
   (`/internal/peer`, with the workers' token; `peer_state.py`) every round (about a second).
2. A peer that answered within `DEAD_AFTER_S` is alive. The leader is the live router whose
   address sorts first, this one included: every router that hears the same answers names the
   same leader, and when the leader dies the next one takes over within `DEAD_AFTER_S`, with
   nothing to hand over (each round decides from the membership every router has).
3. A router that just started follows until it has asked every peer once, so a restarted
   first-sorting router does not act beside the one that led meanwhile before it knows of it.
Two routers that cannot reach each other both lead (each acts on what it sees); on one host or
one network that is the case only while one of them is down.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from pdserve import wire
from pdserve.router.peer_state import PeerState
from pdserve.router_addresses import REFRESH_S, expand, is_dynamic, resolve_name

DEAD_AFTER_S = 3.0
PROBE_TIMEOUT_S = 0.5


class Peers:
    def __init__(self, own_url: str, peers: list[str], clock=time.monotonic, spec: str = "",
                 resolve=resolve_name) -> None:
        self.own_url = own_url.rstrip("/")
        self.peers: list[str] = []
        self.set_peers(peers)
        self.clock = clock
        self.spec = spec  # `--peers` as given: a dns+ name in it is looked up again (`look_up`)
        self.next_lookup = 0.0
        self.resolve = resolve
        self.last_seen: dict[str, float] = {}  # peer -> when it last answered
        self.states: dict[str, PeerState] = {}  # peer -> what it last said
        self.asked_all = not self.peers and not is_dynamic(spec)  # alone: it leads at once

    def set_peers(self, peers: list[str]) -> None:
        self.peers = sorted({p.rstrip("/") for p in peers} - {self.own_url})

    async def look_up(self) -> None:
        """Where `--peers` names routers by a dns+ name, their addresses again, every `REFRESH_S`
        (on Kubernetes, router pods come and go)."""
        if not is_dynamic(self.spec) or self.clock() < self.next_lookup:
            return
        self.next_lookup = self.clock() + REFRESH_S
        try:
            self.set_peers(await asyncio.to_thread(expand, self.spec, self.resolve, True))
        except OSError:  # the name did not resolve this time: the peers it had stay
            return

    def alive(self) -> list[str]:
        now = self.clock()
        return [p for p in self.peers if now - self.last_seen.get(p, -1e18) < DEAD_AFTER_S]

    @property
    def leader(self) -> str:
        return min([self.own_url, *self.alive()])

    @property
    def leading(self) -> bool:
        return self.asked_all and self.leader == self.own_url

    def heard(self, peer: str) -> None:
        self.last_seen[peer] = self.clock()

    def live_states(self) -> dict[str, PeerState]:
        """What each live peer last said, by its address."""
        alive = set(self.alive())
        return {p: s for p, s in self.states.items() if p in alive}

    @property
    def leader_state(self) -> PeerState | None:
        """What the leader last said, where another router leads."""
        leader = self.leader
        return self.states.get(leader) if leader != self.own_url else None

    async def probe(self, http: httpx.AsyncClient, headers: dict[str, str]) -> None:
        """Ask every peer for its state at once; those that answer are alive now."""
        async def ask(peer: str) -> None:
            try:
                r = await http.get(peer + "/internal/peer", headers=headers, timeout=PROBE_TIMEOUT_S)
                if r.status_code == 200:
                    self.states[peer] = wire.decode(r.content, PeerState)
                    self.heard(peer)
            except (httpx.HTTPError, wire.BadMessage):
                return
        await asyncio.gather(*(ask(p) for p in self.peers))
        self.asked_all = True

    def view(self) -> dict:
        return {"url": self.own_url, "leader": self.leader if self.asked_all else None, "leading": self.leading,
                "peers": {p: p in self.alive() for p in self.peers}}
