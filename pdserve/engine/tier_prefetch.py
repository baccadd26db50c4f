"""Reading a waiting request's prefix from the tiers below host memory before it is admitted, on a
thread of its own, so that its admission finds the blocks in memory instead of reading them on
the engine thread.

1. A request enters the waiting queue: the scheduler asks for the blocks of its prefix that
   neither the pool nor the host tier holds (`ask`).
2. This thread reads them in order from the disk tier, then the rest from the store (one
   pipelined round trip per 64 blocks), up to the first that neither holds (or that fails its
   checks: never served), and keeps them ready, at most the host tier's capacity of them (or 64
   blocks, for a smaller one), the oldest let go first.
3. The request's admission (`HostKVTier.find`, engine thread) takes each ready block (`take`)
   into a host slot. A block still on its way is waited for (read once, not twice: an admission
   right after the request came, on an idle engine, waits as it would have read); one never asked
   for, or that this thread could not read, the admission reads itself, as without this thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict

import torch

log = logging.getLogger("pdserve.engine")

MAX_ASKED_BLOCKS = 1024  # of one request
MAX_WAIT_S = 10.0  # for a block on its way (a store past its timeout has failed by then)


def waited(done, timeout_s: float) -> bool:
    """Poll `done()` until it holds (True) or `timeout_s` passes (False): a tier's writer or reader
    thread caught up, for tests and benchmarks."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
    return True


class Prefetcher:
    def __init__(self, disk, store, capacity: int) -> None:
        self.disk, self.store, self.capacity = disk, store, capacity
        self._asks: queue.Queue = queue.Queue()
        self._ready: OrderedDict[int, tuple[str, torch.Tensor]] = OrderedDict()  # hash -> (tier, its KV)
        self._lock = threading.Condition()
        self._on_the_way: dict[int, int] = {}  # asked, not yet read: hash -> asks
        self._pending = 0
        self.num_read = 0  # blocks read ahead
        self.num_used = 0  # of those, taken by an admission
        threading.Thread(target=self._run, name="kv-tier-prefetch", daemon=True).start()

    def ask(self, hashes: list[int]) -> None:
        hashes = list(hashes[:MAX_ASKED_BLOCKS])
        with self._lock:
            self._pending += 1
            for h in hashes:
                self._on_the_way[h] = self._on_the_way.get(h, 0) + 1
        self._asks.put(hashes)

    def take(self, block_hash: int) -> tuple[str, torch.Tensor] | None:
        """(the tier it came from, its KV) of a block read ahead (waited for while on its way), no
        longer kept here; None: not asked for, or not found below."""
        with self._lock:
            self._lock.wait_for(lambda: block_hash not in self._on_the_way, MAX_WAIT_S)
            got = self._ready.pop(block_hash, None)
            self.num_used += got is not None
        return got

    def wait(self, timeout_s: float = 30.0) -> bool:
        """Until every ask so far is read (tests, benchmarks); False if it took longer."""
        return waited(lambda: self._pending == 0, timeout_s)

    def clear(self) -> None:
        with self._lock:
            self._ready.clear()

    def _run(self) -> None:
        while True:
            hashes = self._asks.get()
            try:
                self._read(hashes)
            except Exception:  # a tier that fails here fails the same way for the admission, which says so
                log.exception("KV tier prefetch failed")
            finally:
                with self._lock:
                    self._pending -= 1
                    for h in hashes:
                        self._arrived(h)
                    self._lock.notify_all()

    def _read(self, hashes: list[int]) -> None:
        i = 0
        while i < len(hashes):
            with self._lock:
                ready = hashes[i] in self._ready
            if not ready:
                if self.disk is None or hashes[i] not in self.disk:
                    break
                block = self.disk.load(hashes[i])
                if block is None:
                    return
                self._keep(hashes[i], "disk", block)
            i += 1
        if self.store is not None and i < len(hashes):
            for block_hash, block in zip(hashes[i:], self.store.load_run(hashes[i:])):
                self._keep(block_hash, "store", block)

    def _keep(self, block_hash: int, tier: str, block: torch.Tensor) -> None:
        with self._lock:
            self._ready[block_hash] = (tier, block)
            self._ready.move_to_end(block_hash)
            while len(self._ready) > self.capacity:
                self._ready.popitem(last=False)
            self.num_read += 1
            self._arrived(block_hash)
            self._lock.notify_all()

    def _arrived(self, block_hash: int) -> None:  # under the lock: one ask of it is answered
        left = self._on_the_way.get(block_hash, 0) - 1
        if left > 0:
            self._on_the_way[block_hash] = left
        else:
            self._on_the_way.pop(block_hash, None)
