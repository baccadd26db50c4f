"""Every KV transfer backend by name, as both sides of a transfer need it: the prefill side's sender
class, and what the decode side adds to its KV address in its offer.

A worker's transfer list names backends in its order of preference; a prefill worker tries them in
that order and falls back to the next when one cannot connect. `memory` (one process, for tests)
is in no default list: it serves only a worker that names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.kv_transfer.api import SenderFactory
from pdserve.kv_transfer.base import DraftKV, KVLayout
from pdserve.kv_transfer.leases import LeaseTable


@dataclass(frozen=True, slots=True)
class DecodeSide:
    """What a decode worker offers its KV through."""

    layout: KVLayout
    kv_cache: torch.Tensor  # [layers, slots, 2, kv_heads, head_dim]
    leases: LeaseTable
    token: str
    shared_pool_path: str | None  # the cache's file, when it lives in shared memory
    draft: DraftKV | None = None  # a draft model's cache, where the worker drafts with one


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    available: Callable[[], bool]  # whether this process can use it at all
    sender: Callable[[], SenderFactory]  # imported on first use: nixl is an optional dependency
    offer: Callable[[DecodeSide], dict | None]  # added to the KV address; None: not offered
    release: Callable[[torch.Tensor], None] = lambda kv_cache: None  # when a worker stops: free what the cache holds
    in_process: bool = False  # tests only: a peer in this process


def _tcp_sender() -> SenderFactory:
    from pdserve.kv_transfer.tcp import TcpSender
    return TcpSender


def _shm_available() -> bool:
    from pdserve.kv_transfer.shm import shm_available
    return shm_available()


def _shm_sender() -> SenderFactory:
    from pdserve.kv_transfer.shm import ShmSender
    return ShmSender


def _shm_offer(side: DecodeSide) -> dict | None:
    if side.shared_pool_path is None:
        return None
    return {"path": side.shared_pool_path, "num_slots": side.kv_cache.shape[1]}


def _nixl_available() -> bool:
    from pdserve.kv_transfer.nixl import nixl_available
    return nixl_available()


def _nixl_sender() -> SenderFactory:
    from pdserve.kv_transfer.nixl import NixlSender
    return NixlSender


def _nixl_offer(side: DecodeSide) -> dict:
    from pdserve.kv_transfer.nixl import local_agent
    return local_agent(side.kv_cache).offer()


def _nixl_release(kv_cache: torch.Tensor) -> None:
    from pdserve.kv_transfer.nixl import release_agent
    release_agent(kv_cache)


def _memory_sender() -> SenderFactory:
    from pdserve.kv_transfer.memory import MemorySender
    return MemorySender


def _memory_offer(side: DecodeSide) -> dict:
    from pdserve.kv_transfer.memory import publish
    return publish(side.layout, side.kv_cache, side.leases, side.token, side.draft)


def _memory_release(kv_cache: torch.Tensor) -> None:
    from pdserve.kv_transfer.memory import withdraw
    withdraw(kv_cache)


BACKENDS: dict[str, Backend] = {
    "nixl": Backend("nixl", _nixl_available, _nixl_sender, _nixl_offer, _nixl_release),
    "tcp": Backend("tcp", lambda: True, _tcp_sender, lambda side: {}),
    "shm": Backend("shm", _shm_available, _shm_sender, _shm_offer),
    "memory": Backend("memory", lambda: True, _memory_sender, _memory_offer, _memory_release, in_process=True),
}

# What a deployment chooses from; the others serve tests that name them.
PRODUCTION_BACKENDS = tuple(name for name, b in BACKENDS.items() if not b.in_process)


def sender_types(names: list[str]) -> dict[str, SenderFactory]:
    """The sender class of each named backend this process can use."""
    return {name: BACKENDS[name].sender() for name in names if BACKENDS[name].available()}


def offers(names: list[str], side: DecodeSide, address: dict) -> dict[str, dict]:
    """The decode worker's offer per named backend it can serve: its KV address (where frames go,
    and which tells its peers apart) and what the backend adds."""
    out = {}
    ranks = {"ranks": side.layout.ranks}  # its tensor-parallel ranks: senders write their split of the heads
    for name in names:
        backend = BACKENDS[name]
        extra = backend.offer(side) if backend.available() else None
        if extra is not None:
            out[name] = {**address, **extra, **ranks}
    return out


def release(names: list[str], kv_cache: torch.Tensor) -> None:
    """What the named backends hold for this cache (a NIXL registration, a published endpoint)."""
    for name in names:
        if BACKENDS[name].available():
            BACKENDS[name].release(kv_cache)
