"""A pdserve cluster on Ray: the router and every worker as `ProcessActor`s, held by one named
actor that `pdserve serve --ray` starts and `pdserve scale` finds by its name.

Lifecycle:
1. `start()`: the router on the node its resources ask for (the head node by default: its
   address must outlive any worker), or `--routers` replicas each pinned to a node of its own
   where there are nodes enough (the head node's first), then each pool's workers on theirs (in a placement group of
   the chosen strategy, where one is asked for), registered with the router. Ready when every
   worker has registered.
2. A monitor thread asks each actor for its status every second and turns what changed into
   events: the child's own (exited, restarted, ready_again, crash_loop, from the in-actor
   supervisor), an actor down (its node lost: Ray restarts it where it fits), an actor back on a
   node (`actor_restarted`), and an actor Ray gave up on after `max_restarts` (`actor_lost`).
3. `scale(prefill, decode, colocated)`: a pool grows by new actors, or shrinks by draining its
   newest workers (they finish their requests and leave the router), then removing their actors.
4. `stop()`: every actor stopped, placement groups removed. The actors are this actor's, and it is
   the driver's: should `pdserve serve --ray` end, Ray ends all of them.
"""

from __future__ import annotations

import argparse
import itertools
import threading
from dataclasses import dataclass, field

from pdserve.credentials import API_KEY_ENV
from pdserve.launcher import router_argv, served_model, wait_registered, worker_argv
from pdserve.on_ray.process_actor import DURABLE_PLACEHOLDER
from pdserve.on_ray.placement import HEAD_NODE, Resources, router_homes
from pdserve.on_ray.process_actor import ProcessActor

POOLS = ("prefill", "decode", "both")
STATUS_TIMEOUT_S = 5.0


@dataclass(slots=True)
class DeploymentSpec:
    args: dict  # `pdserve serve`'s flags (a Namespace's vars)
    engine_argv: list[str]  # the engine flags every worker gets
    env: dict[str, str]  # the cluster's secrets, for the children's environment
    router: Resources
    pools: dict[str, Resources]  # per pool ("prefill", "decode", "both")
    placement: str | None  # Ray placement-group strategy per pool (None: none)
    max_actor_restarts: int  # Ray restarts of one actor (-1: no limit)
    policy: dict  # the in-actor supervisor's RestartPolicy fields
    drain_timeout_s: float = 60.0


@dataclass(eq=False, slots=True)
class Member:
    name: str
    role: str  # "router" or a pool
    actor: object
    slot: tuple | None = None  # (placement group, bundle index) it runs in, if placed in one
    incarnation: str | None = None
    since: int = 0  # the actor's events already taken
    state: str = "starting"  # starting, serving, down, draining, lost
    node_ip: str = ""
    node_id: str = ""
    url: str | None = None
    pid: int | None = None
    actor_restarts: int = 0
    child_restarts: int = 0

    def view(self) -> dict:
        return {"name": self.name, "role": self.role, "state": self.state, "node_ip": self.node_ip,
                "node_id": self.node_id, "url": self.url, "pid": self.pid, "actor_restarts": self.actor_restarts,
                "process_restarts": self.child_restarts}


@dataclass(slots=True)
class _Events:
    items: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def emit(self, event: dict) -> None:
        with self.lock:
            self.items.append(event)

    def since(self, n: int) -> list[dict]:
        with self.lock:
            return self.items[n:]


class Deployment:
    """Used as a named `ray.remote(Deployment)` with several concurrent calls (events and scale)."""

    def __init__(self, spec: DeploymentSpec) -> None:
        import ray

        self.ray, self.spec = ray, spec
        self.args = argparse.Namespace(**spec.args)
        self.remote_process = ray.remote(ProcessActor)
        self.members: list[Member] = []
        self.events = _Events()
        self.router_url = ""  # the clients' (the first router's)
        self.routers_spec = ""  # with replicas: every router's own address, as workers are given them
        self._numbers = itertools.count()
        self._groups: list = []  # placement groups made, removed at stop
        self._free_slots: dict[str, list[tuple]] = {}  # per pool: bundles of removed workers, for new ones
        self._scaling = threading.Lock()
        self._stopping = threading.Event()

    # -- start and watch ----------------------------------------------------------------------

    def start(self) -> dict:
        timeout = self.args.ready_timeout
        routers, self.routers_spec = self._add_routers()
        self._await_ready(routers, timeout)
        self.router_url = routers[0].url
        for pool in POOLS:
            self._add_workers(pool, self._wanted(pool), timeout)
        wait_registered(self.router_url, len(self._workers()), timeout)
        threading.Thread(target=self._monitor, name="monitor", daemon=True).start()
        model = served_model(self.router_url, self.spec.env.get(API_KEY_ENV, ""))
        return {"url": self.router_url, "model": model, "members": self.view()}

    def _add_routers(self) -> tuple[list[Member], str]:
        """The router, or `--routers` replicas each pinned to a node of its own where the cluster has
        enough (`router_homes`): all listen on `--port` (SO_REUSEPORT where two share a node), each
        also on a port of its own (`--port` + 1 + its number) where workers register and routers ask
        each other who leads. Returns them and the routers' addresses the workers register with."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        args, count = self.args, self.args.routers
        if count == 1:
            router = self._add_actor("router", "router", router_argv(args, "{node_ip}", args.port), self.spec.router)
            return [router], ""
        homes = router_homes(self.ray.nodes(), count, self.spec.router)
        own = [f"http://{ip}:{args.port + 1 + i}" for i, (_, ip) in enumerate(homes)]
        pinned = Resources(self.spec.router.cpus, self.spec.router.gpus,
                           {k: v for k, v in self.spec.router.custom.items() if k != HEAD_NODE})
        routers = []
        for i, (node_id, _) in enumerate(homes):
            argv = [*router_argv(args, "{node_ip}", args.port), "--reuse-port", "--internal-port",
                    str(args.port + 1 + i), "--peers", ",".join(own)]
            routers.append(self._add_actor(f"router {i}", "router", argv, pinned,
                                           strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)))
        return routers, ",".join(own)

    def _wanted(self, pool: str) -> int:
        return {"prefill": self.args.prefill, "decode": self.args.decode, "both": self.args.colocated}[pool]

    def _workers(self, pool: str | None = None) -> list[Member]:
        return [m for m in self.members if m.role != "router" and (pool is None or m.role == pool)
                and m.state not in ("draining", "lost")]

    def _add_actor(self, name: str, role: str, argv: list[str], resources: Resources, slot: tuple | None = None,
                   strategy=None) -> Member:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options = {**resources.actor_options(), "max_restarts": self.spec.max_actor_restarts, "max_concurrency": 4}
        if slot is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(*slot)
        elif strategy is not None:
            options["scheduling_strategy"] = strategy
        actor = self.remote_process.options(**options).remote(name, argv, self.spec.env, self.spec.policy)
        member = Member(name, role, actor, slot)
        self.members.append(member)
        return member

    def _add_workers(self, pool: str, count: int, timeout: float) -> list[Member]:
        if count <= 0:
            return []
        resources = self.spec.pools[pool]
        slots = self._slots(pool, count, timeout) if self.spec.placement else [None] * count
        added = []
        for slot in slots:
            number = next(self._numbers)
            argv = [*worker_argv(self.args, self.spec.engine_argv, pool, number, self.routers_spec or self.router_url,
                                 "{node_ip}",
                                 self.args.threads or resources.threads()), "--node-name", "{node}"]
            if self.args.durable_kv and pool != "prefill":  # its actor names the pool file, on its node
                argv += ["--durable-kv", DURABLE_PLACEHOLDER]
            added.append(self._add_actor(f"{pool} worker {number}", pool, argv, resources, slot))
        try:
            self._await_ready(added, timeout)
        except RuntimeError:
            self._stop_and_kill(added, 2.0)  # none left half-started, their bundles free again
            raise
        return added

    def _slots(self, pool: str, count: int, timeout: float) -> list[tuple]:
        """(placement group, bundle) for `count` more workers of `pool`: bundles that workers removed
        by a scale-down left free first (a placement group keeps its bundles reserved), then a new
        group of the pool's strategy for the rest."""
        free = self._free_slots.setdefault(pool, [])
        slots = [free.pop() for _ in range(min(count, len(free)))]
        missing = count - len(slots)
        if missing:
            bundle = self.spec.pools[pool].bundle()
            pg = self.ray.util.placement_group([bundle] * missing, strategy=self.spec.placement)
            try:
                self.ray.get(pg.ready(), timeout=timeout)
            except self.ray.exceptions.GetTimeoutError:
                self.ray.util.remove_placement_group(pg)
                free.extend(slots)
                raise RuntimeError(f"no placement of {missing} more {pool} workers ({self.spec.placement}, each "
                                   f"{bundle}) fits this cluster within {timeout:.0f}s") from None
            self._groups.append(pg)
            slots += [(pg, i) for i in range(missing)]
        return slots

    def _await_ready(self, members: list[Member], timeout: float) -> None:
        refs = [m.actor.ready.remote(timeout) for m in members]
        _, pending = self.ray.wait(refs, num_returns=len(refs), timeout=timeout + STATUS_TIMEOUT_S)
        if pending:
            names = ", ".join(m.name for m, r in zip(members, refs) if r in pending)
            raise RuntimeError(f"{names} not ready within {timeout:.0f}s: no node has the resources asked "
                               f"(see `ray status`), or the process did not start")
        for m, ref in zip(members, refs):
            try:
                self._take_status(m, self.ray.get(ref))
            except self.ray.exceptions.RayTaskError as e:
                raise RuntimeError(f"{m.name}: {e.cause}") from None
            m.state = "serving"

    def _monitor(self) -> None:
        while not self._stopping.wait(1.0):
            for m in list(self.members):
                if m.state not in ("lost", "draining"):
                    self._check(m)

    def _check(self, m: Member) -> None:
        exc = self.ray.exceptions
        try:
            status = self.ray.get(m.actor.status.remote(m.since), timeout=STATUS_TIMEOUT_S)
        except exc.ActorDiedError:
            if self._stopping.is_set() or m not in self.members:
                return  # killed on purpose meanwhile (stop, or a scale-down)
            m.state = "lost"
            self.events.emit({"event": "actor_lost", "name": m.name, "node_ip": m.node_ip,
                              "max_restarts": self.spec.max_actor_restarts})
            return
        except (exc.RayActorError, exc.ActorUnavailableError, exc.GetTimeoutError):
            if m.state != "down":
                m.state = "down"
                self.events.emit({"event": "actor_down", "name": m.name, "node_ip": m.node_ip, "node_id": m.node_id})
            return
        restarted = m.incarnation is not None and status["incarnation"] != m.incarnation
        self._take_status(m, status)
        if restarted:
            m.actor_restarts += 1
            self.events.emit({"event": "actor_restarted", "name": m.name, "node_ip": m.node_ip,
                              "node_id": m.node_id, "restarts": m.actor_restarts})
        if m.state == "down" and status["url"]:
            self.events.emit({"event": "ready_again", "name": m.name, "pid": m.pid, "url": m.url,
                              "load_seconds": None})
        if status["url"]:
            m.state = "serving"

    def _take_status(self, m: Member, status: dict) -> None:
        if status["incarnation"] != m.incarnation:
            m.incarnation, m.since = status["incarnation"], 0
        for event in status["events"]:
            self.events.emit(event)
        m.since += len(status["events"])
        m.node_ip, m.node_id, m.url, m.pid = status["node_ip"], status["node_id"], status["url"], status["pid"]
        m.child_restarts = status["restarts"]

    # -- the API of `pdserve serve --ray` and `pdserve scale` ---------------------------------

    def view(self) -> list[dict]:
        return [m.view() for m in self.members]

    def events_since(self, n: int) -> list[dict]:
        return self.events.since(n)

    def scale(self, wanted: dict[str, int], timeout: float) -> list[dict]:
        """Each named pool to its number of workers, new ones ready within `timeout` seconds; the
        members after."""
        with self._scaling:
            left = {pool: len(self._workers(pool)) for pool in POOLS}
            left.update(wanted)
            if sum(left.values()) < 1:
                raise ValueError("a cluster needs at least one worker")
            for pool, count in wanted.items():
                have = self._workers(pool)
                if count > len(have):
                    for m in self._add_workers(pool, count - len(have), timeout):
                        self.events.emit({"event": "added", "name": m.name, "node_ip": m.node_ip, "url": m.url})
                elif count < len(have):
                    self._remove(have[count:])
            wait_registered(self.router_url, len(self._workers()), timeout)
            return self.view()

    def _remove(self, members: list[Member]) -> None:
        for m in members:
            m.state = "draining"
            self.events.emit({"event": "draining", "name": m.name, "node_ip": m.node_ip})
        refs = [m.actor.drain.remote(self.spec.drain_timeout_s) for m in members]
        self.ray.wait(refs, num_returns=len(refs), timeout=self.spec.drain_timeout_s + STATUS_TIMEOUT_S)
        self._stop_and_kill(members, 2.0)  # a worker still running past its drain is stopped
        for m in members:
            self.events.emit({"event": "removed", "name": m.name, "node_ip": m.node_ip})

    def _stop_and_kill(self, members: list[Member], grace_s: float) -> None:
        refs = [m.actor.stop.remote(grace_s) for m in members]
        self.ray.wait(refs, num_returns=len(refs), timeout=grace_s + STATUS_TIMEOUT_S)
        for m in members:  # gone already, or stuck: killed either way
            self.ray.kill(m.actor, no_restart=True)
            self.members.remove(m)
            if m.slot is not None:
                self._free_slots.setdefault(m.role, []).append(m.slot)

    def stop(self, grace_s: float) -> None:
        self._stopping.set()
        self._stop_and_kill(sorted(self.members, key=lambda m: m.role == "router"), grace_s)  # workers first
        for pg in self._groups:
            self.ray.util.remove_placement_group(pg)
