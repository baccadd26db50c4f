"""Where each pdserve actor goes on a Ray cluster: resource dicts as the user writes them, turned
into Ray's actor options. Pure: tested without Ray.

A pool's resources are a JSON object, e.g. `{"GPU": 1, "prefill_node": 1}`: `CPU` and `GPU` are
Ray's `num_cpus` and `num_gpus`, every other key a custom resource (a label a node was started
with, `ray start --resources '{"prefill_node": 8}'`). A worker's torch threads are its CPUs.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

MAX_RESOURCE = 1e6
_RESOURCE_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
HEAD_NODE = "node:__internal_head__"  # a resource only the head node has, a little of
PLACEMENTS = ("default", "spread", "strict-spread", "pack")


@dataclass(frozen=True, slots=True)
class Resources:
    """What one actor asks of its node."""

    cpus: float = 1.0
    gpus: float = 0.0
    custom: dict[str, float] = field(default_factory=dict)

    def actor_options(self) -> dict:
        return {"num_cpus": self.cpus, "num_gpus": self.gpus, **({"resources": dict(self.custom)} if self.custom else {})}

    def bundle(self) -> dict[str, float]:
        """The same as one placement-group bundle (zero amounts left out, as Ray wants)."""
        return {k: v for k, v in {"CPU": self.cpus, "GPU": self.gpus, **self.custom}.items() if v > 0}

    def threads(self) -> int:
        """Torch threads for a worker given these CPUs (at least one)."""
        return max(1, math.floor(self.cpus))


def parse_resources(text: str | None, default: Resources, flag: str) -> Resources:
    """A pool's resources from its flag's JSON (None: `default`), or ValueError naming the flag."""
    if text is None:
        return default
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(f"{flag} takes a JSON object such as '{{\"GPU\": 1, \"prefill_node\": 1}}', got {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} takes a JSON object of resource names and amounts, got {text!r}")
    for name, amount in value.items():
        if not _RESOURCE_NAME.fullmatch(name):
            raise ValueError(f"{flag}: {name!r} is not a resource name (up to 128 letters, digits and _.:-)")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 <= amount <= MAX_RESOURCE:
            raise ValueError(f"{flag}: {name} must be a number from 0 to {MAX_RESOURCE:g}, got {amount!r}")
    custom = {k: float(v) for k, v in value.items() if k not in ("CPU", "GPU")}
    return Resources(float(value.get("CPU", default.cpus)), float(value.get("GPU", default.gpus)), custom)


def worker_default(device: str, ranks: int = 1) -> Resources:
    """A CPU per tensor-parallel rank, and a GPU per rank for a worker that computes on CUDA: the
    worker's ranks are its own processes, on its node."""
    return Resources(float(ranks), float(ranks) if device.startswith("cuda") else 0.0)


ROUTER_DEFAULT = Resources(0.0, 0.0, {HEAD_NODE: 0.001})  # on the head node: its address stays the same


def placement_strategy(name: str) -> str | None:
    """Ray's placement-group strategy for `--placement` (None: no placement group)."""
    if name not in PLACEMENTS:
        raise ValueError(f"--placement takes one of {', '.join(PLACEMENTS)}, got {name!r}")
    return None if name == "default" else name.replace("-", "_").upper()


def router_homes(nodes: list[dict], count: int, wanted: Resources) -> list[tuple[str, str]]:
    """(node id, node address) for each of `count` router replicas, from `ray.nodes()`: the head
    node first, then the other live nodes (by id, so the same cluster gives the same answer), one
    router each while there are nodes enough, then round again. Only nodes with every custom
    resource `wanted` asks (bar the head-node marker) are chosen. Each router stays on its node,
    so its address, which the workers and the other routers were given, outlives its restarts."""
    labels = {k for k in wanted.custom if k != HEAD_NODE}
    alive = [n for n in nodes if n.get("Alive") and labels <= set(n.get("Resources") or {})]
    if not alive:
        raise ValueError("no live Ray node has the resources --router-resources asks for")
    head = [n for n in alive if HEAD_NODE in (n.get("Resources") or {})]
    ordered = head + sorted((n for n in alive if n not in head), key=lambda n: n["NodeID"])
    return [(ordered[i % len(ordered)]["NodeID"], ordered[i % len(ordered)]["NodeManagerAddress"])
            for i in range(count)]
