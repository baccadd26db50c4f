"""One prompt's KV through a backend's real sender and receiver, timed: what `pdserve bench
transfer` compares between backends and `pdserve profile` measures for the simulator. A self-test
of the transfer path as much as a timing: a transfer that does not land, or lands changed, raises."""

from __future__ import annotations

import queue
import time
from typing import Any

import torch

from pdserve.kv_transfer.base import KVLayout, Lease
from pdserve.kv_transfer.receiver import EventKind, KVReceiver
from pdserve.kv_transfer.shm import SharedKVPool, ShmSender
from pdserve.kv_transfer.tcp import TcpSender
from pdserve.models.arch_config import ArchConfig


class TransferMismatch(RuntimeError):
    """A benchmarked transfer did not do its job: no LANDED, or the KV arrived changed. A plain
    exception, not an `assert`, so that the check still runs under `python -O`."""


class Link:
    """Every layer of an n-token prompt through one backend's real sender and receiver into leased
    blocks, from the first write to LANDED (the lease is claimed before, as a prefill worker does
    on accepting it, while it computes)."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, backend: str, num_tokens: int, encoding: str = "raw"):
        self.cfg, self.backend, self.num_tokens, self.encoding = cfg, backend, num_tokens, encoding
        layout = KVLayout.of(cfg, dtype)
        self.block = 16
        slots = -(-num_tokens // self.block) * self.block
        shape = (cfg.num_layers, slots, 2, cfg.num_kv_heads, cfg.head_dim)
        self.src = torch.randn(shape).to(dtype)
        self.pool = SharedKVPool(shape, dtype) if backend == "shm" else None
        self.dst = self.pool.tensor if self.pool is not None else torch.zeros(shape, dtype=dtype)
        self.events: queue.Queue = queue.Queue()
        self.rx = KVReceiver(layout, self.dst, self.events)
        peer: dict[str, Any] = {"host": self.rx.address[0], "port": self.rx.address[1]}
        if backend == "shm":
            peer.update(path=self.pool.path, num_slots=slots)
        if backend == "nixl":
            from pdserve.kv_transfer.nixl import NixlSender, local_agent
            peer.update(local_agent(self.dst).offer())
            sender_type = NixlSender
        else:
            sender_type = {"tcp": TcpSender, "shm": ShmSender}[backend]
        self.sender = sender_type(layout, self.src, peer, encoding=encoding)
        self.table = list(range(slots // self.block))
        self.fences = iter(range(1, 1 << 30))

    def once(self) -> float:
        n, sender = self.num_tokens, self.sender
        lease = Lease("bench", next(self.fences), self.table, self.block, 0, n, time.monotonic() + 600)
        self.rx.open_lease(lease)
        sender.prepare(lease)
        sender.flush()
        t0 = time.perf_counter()
        for layer in range(self.cfg.num_layers):
            sender.write(lease, layer, 0, n, [(0, n)])
        sender.notify(lease, 0)
        while True:
            try:
                event = self.events.get(timeout=1.0)
                break
            except queue.Empty:
                if not sender.alive:
                    raise RuntimeError(f"the {self.backend} link failed during the transfer") from None
        seconds = time.perf_counter() - t0
        if event.kind != EventKind.LANDED:
            raise TransferMismatch(f"{self.backend}: the transfer ended in {event.kind.name}, not LANDED: {event}")
        sender.forget(lease)
        return seconds

    def close(self) -> None:
        n = self.num_tokens
        # compared before the pool closes (shm's destination is that pool); raised after, so nothing leaks
        changed = self.encoding == "raw" and not torch.equal(self.dst[:, :n], self.src[:, :n])
        self.sender.close()
        self.rx.close()
        if self.backend == "nixl":
            from pdserve.kv_transfer.nixl import release_agent
            release_agent(self.src)
            release_agent(self.dst)
        if self.pool is not None:
            self.pool.close()
        if changed:
            raise TransferMismatch(f"{self.backend}: KV arrived changed")
