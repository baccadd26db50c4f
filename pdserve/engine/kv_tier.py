"""A second home for prefix blocks the pool evicts (`--host-kv-memory`): a bounded region of host
memory, least recently used first, raw or int8 (half the bytes of bf16, a quarter of float32).

Lifecycle of a block's KV:
1. The pool evicts a cached block (its hash names a full block of some prefix) to give it to
   another request: the block manager hands it here (`evicted`) at once, and its layers are
   copied out before anything can write it (a prefill worker may be told to fill it the same
   moment). The copy is on the engine thread: a block of the default model is 368 KB in bf16.
2. A request whose prefix the pool no longer holds asks `find` for the blocks that follow its
   pool hit; the scheduler allocates pool blocks for them (`promote`), and `settle`, which the
   engine calls after every schedule, copies them in before any step reads them: the request
   computes only what neither holds.
3. A block the tier has no room for pushes out the least recently used one.

int8 keeps one scale per token, layer, K or V and head (as the int8 KV transfer does): the
prefix it brings back is close to the computed one, not equal (a hit then samples from slightly
different logits); raw keeps it exact.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import zlib
from collections import OrderedDict
from pathlib import Path

import torch

from pdserve.engine.tier_prefetch import Prefetcher, waited

log = logging.getLogger("pdserve.engine")

ENCODINGS = ("raw", "int8")
STAGING_BLOCKS = 64  # the host tier a disk tier gets where none was asked for: its reads and writes pass it
MAX_PENDING_WRITES = 256  # blocks copied out for the disk tier's writer, not yet written


def make_tiers(config, kv_cache: torch.Tensor, block_bytes: int, kv_name: str) -> HostKVTier | None:
    """The tiers `config` asks for (`host_kv_memory`, `disk_kv_path`, `kv_store`) under a pool of
    blocks of `block_bytes`; `kv_name` names the model (and head) whose KV the disk's files and the
    store's keys hold."""
    if not (config.host_kv_memory or config.disk_kv_path or config.kv_store):
        return None
    tier = HostKVTier(config.host_kv_memory or STAGING_BLOCKS * block_bytes, kv_cache, config.block_size,
                      config.host_kv_encoding)
    log.info("host KV tier: %d blocks (%s)", tier.capacity, config.host_kv_encoding)
    block = kv_cache[:, : config.block_size]  # a lower tier holds this model's blocks only: the key names the layout
    layout_key = hashlib.sha256(f"{kv_name}:{tuple(block.shape)}:{block.dtype}".encode()).hexdigest()[:24]
    if config.disk_kv_path:
        tier.spill = DiskKVTier(config.disk_kv_path, config.disk_kv_memory, layout_key, block)
        log.info("disk KV tier: %s, %d blocks", tier.spill.dir, tier.spill.capacity)
    if config.kv_store:
        from pdserve.engine.kv_store import StoreKVTier

        tier.store = StoreKVTier(config.kv_store, layout_key, block)
        log.info("KV store tier: %s", config.kv_store)
    if tier.spill is not None or tier.store is not None:
        tier.prefetcher = Prefetcher(tier.spill, tier.store, max(tier.capacity, STAGING_BLOCKS))
    return tier


def tier_stats(tier: HostKVTier | None) -> dict:
    """What a worker's stats say of its tiers below the pool (a shared store's id and counters)."""
    return tier.store.stats() if tier is not None and tier.store is not None else {}


class HostKVTier:
    def __init__(self, capacity_bytes: int, kv_cache: torch.Tensor, block_size: int, encoding: str = "raw") -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"the host KV tier holds {' or '.join(ENCODINGS)}, not {encoding!r}")
        layers, _, _, heads, head_dim = kv_cache.shape
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.encoding = encoding
        shape = (layers, block_size, 2, heads, head_dim)
        value = torch.int8 if encoding == "int8" else kv_cache.dtype
        per_block = torch.Size(shape).numel() * value.itemsize + (
            torch.Size(shape[:-1]).numel() * 4 if encoding == "int8" else 0)
        self.capacity = capacity_bytes // per_block
        if self.capacity < 1:
            raise ValueError(f"host_kv_memory={capacity_bytes} bytes holds no block ({per_block} bytes each)")
        pin = kv_cache.device.type == "cuda"
        self._values = torch.empty((self.capacity, *shape), dtype=value, pin_memory=pin)
        self._scales = torch.empty((self.capacity, *shape[:-1]), dtype=torch.float32) if encoding == "int8" else None
        self._index: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, least recently used first
        self._free = list(range(self.capacity - 1, -1, -1))
        self._to_load: list[tuple[int, int]] = []  # (slot, pool block id), before the next step
        # slots `find` gave since the last step: kept from reuse until then (the pool may evict
        # blocks into here while allocating blocks for them)
        self._pinned: set[int] = set()
        self._staged: dict[int, torch.Tensor] = {}  # disk blocks read with no slot free here, by negative id
        self.num_saved = 0
        self.num_loaded = 0
        self.spill: DiskKVTier | None = None  # where blocks it lets go are written (`--disk-kv-path`)
        self.store = None  # a StoreKVTier: evicted blocks go there too; read where nothing above holds them
        self.found_below: dict[str, int] = {}  # of the slots the last `find` gave, those from disk, the store
        self.prefetcher: Prefetcher | None = None  # reads waiting requests' blocks from disk and the store

    def __len__(self) -> int:
        return len(self._index)

    def clear(self) -> None:
        """Forget every block (a benchmark's cold runs start alike)."""
        self._index.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        self._to_load.clear()
        self._pinned.clear()
        self._staged.clear()
        if self.prefetcher is not None:
            self.prefetcher.clear()

    # -- the block manager's side ---------------------------------------------------------------

    @torch.inference_mode()
    def evicted(self, block_hash: int, block_id: int) -> None:
        """The pool is giving a cached block to another request: keep its KV (copied now)."""
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            return
        slot = self._take_slot(self._pinned)
        if slot is None:
            return  # everything here is about to be loaded: this block is lost
        self._index[block_hash] = slot
        self._store(slot, self._pool_block(block_id))
        self.num_saved += 1
        if self.store is not None:  # copied out now, sent by the store's writer thread
            self.store.save(block_hash, self._pool_block(block_id))

    def computed(self, block_hash: int, block_id: int) -> None:
        """A pool block just filled by a step: a store shares it now (copied out at once), so other
        workers read it rather than compute it, whether or not this pool ever lets it go."""
        if self.store is not None:
            self.store.save(block_hash, self._pool_block(block_id))

    def prefetch(self, hashes: list[int]) -> None:
        """A waiting request's prefix blocks after the pool's: those not here are read ahead from
        the tiers below, off the engine thread (`tier_prefetch.py`)."""
        if self.prefetcher is None:
            return
        i = 0
        while i < len(hashes) and hashes[i] in self._index:
            i += 1
        if i < len(hashes):
            self.prefetcher.ask(hashes[i:])

    @torch.inference_mode()
    def find(self, hashes: list[int]) -> list[int]:
        """Slots holding the leading blocks of these hashes, up to the first it lacks; a block on
        disk, or in the store, is read back into a slot on the way: taken from what was read ahead
        while the request waited, else read here (a disk read per block, one store round trip for
        the rest). `found_below` says how many were."""
        slots: list[int] = []
        self.found_below = {"disk": 0, "store": 0}
        for i, block_hash in enumerate(hashes):
            slot = self._index.get(block_hash)
            if slot is None and self.prefetcher is not None and (ahead := self.prefetcher.take(block_hash)):
                slot = self._keep(block_hash, ahead[1])
                self.found_below[ahead[0]] += 1
            if slot is None and self.spill is not None and block_hash in self.spill:
                block = self.spill.load(block_hash)
                if block is None:
                    break
                slot = self._keep(block_hash, block)
                self.found_below["disk"] += 1
            if slot is None:
                if self.store is not None:
                    for later, block in zip(hashes[i:], self.store.load_run(hashes[i:])):
                        slots.append(self._keep(later, block, pin=True))
                        self.found_below["store"] += 1
                break
            if slot >= 0:
                self._index.move_to_end(block_hash)
                self._pinned.add(slot)
            slots.append(slot)
        return slots

    def _keep(self, block_hash: int, block: torch.Tensor, pin: bool = False) -> int:
        """A block read from below: into a slot, or where every slot is spoken for, staged to go to
        the pool from where it is (a negative id)."""
        slot = self._take_slot(self._pinned)
        if slot is None:
            slot = -1 - len(self._staged)
            self._staged[slot] = block
            return slot
        self._index[block_hash] = slot
        self._store(slot, block)
        if pin:
            self._pinned.add(slot)
        return slot

    def promote(self, slots: list[int], block_ids: list[int]) -> None:
        """Those slots' KV goes into these pool blocks before the next step."""
        self._to_load += zip(slots, block_ids)

    # -- before a step (engine thread) ----------------------------------------------------------

    @torch.inference_mode()
    def settle(self) -> None:
        """Copy what requests found here into the pool blocks they were given."""
        loads, self._to_load = self._to_load, []
        self._pinned.clear()
        for slot, block_id in loads:
            staged = self._staged.get(slot)
            self._pool_block(block_id).copy_(self._fetch(slot) if staged is None else staged.to(self.kv_cache.device))
            self.num_loaded += 1
        self._staged.clear()

    def _take_slot(self, keep: set[int]) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash, slot in self._index.items():  # least recently used first
            if slot not in keep:
                del self._index[block_hash]
                if self.spill is not None:  # let go of here, kept there
                    self.spill.save(block_hash, self._fetch(slot))
                return slot
        return None

    def _pool_block(self, block_id: int) -> torch.Tensor:
        start = block_id * self.block_size
        return self.kv_cache[:, start : start + self.block_size]

    def _store(self, slot: int, block: torch.Tensor) -> None:
        if self._scales is None:
            self._values[slot].copy_(block)
            return
        x = block.float()
        scale = x.abs().amax(dim=-1).clamp_min(1e-8) / 127.0
        self._scales[slot].copy_(scale)
        self._values[slot].copy_(torch.round(x / scale.unsqueeze(-1)).to(torch.int8))

    def _fetch(self, slot: int) -> torch.Tensor:
        values = self._values[slot]
        if self._scales is None:
            return values.to(self.kv_cache.device, non_blocking=True)
        return (values.float() * self._scales[slot].unsqueeze(-1)).to(self.kv_cache.dtype).to(self.kv_cache.device)


class DiskKVTier:
    """Blocks the host tier lets go, as files under a directory of their KV layout's own
    (`--disk-kv-path`, bounded by `--disk-kv-memory`): one file a block, named by its prefix hash,
    written whole then renamed into place, its bytes checked (CRC-32) when read back. A file that
    does not check out is deleted and its block computed again, never served. The files outlive
    the worker: one started again with the same model and layout finds them. The engine thread
    only copies a block out; a writer thread writes it (until then it is read from the copy), at
    most `MAX_PENDING_WRITES` waiting, past which a block is not kept (counted)."""

    MAGIC = b"PDSKV1\0\0"

    def __init__(self, root: str | Path, capacity_bytes: int, layout_key: str, block: torch.Tensor) -> None:
        self.dir = Path(root) / layout_key
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shape, self.dtype = tuple(block.shape), block.dtype
        self.block_bytes = block.numel() * block.element_size()
        self.capacity = capacity_bytes // (self.block_bytes + 16)
        if self.capacity < 1:
            raise ValueError(f"disk_kv_memory={capacity_bytes} bytes holds no block ({self.block_bytes} bytes each)")
        found = sorted(self.dir.glob("*.kv"), key=lambda p: p.stat().st_mtime)
        self._index: OrderedDict[int, Path] = OrderedDict()
        for path in found:
            try:
                self._index[int(path.stem, 16)] = path
            except ValueError:
                continue
        while len(self._index) > self.capacity:
            self._drop(next(iter(self._index)))
        self.num_written = 0
        self.num_read = 0
        self.num_corrupt = 0
        self.num_dropped = 0  # not kept: too many waited to be written
        self._lock = threading.Lock()  # the engine thread saves and reads, the writer writes, the prefetch reads
        self._pending: dict[int, torch.Tensor] = {}  # copied out, not yet written
        self._writes: queue.Queue = queue.Queue()
        threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True).start()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index or block_hash in self._pending

    def save(self, block_hash: int, block: torch.Tensor) -> None:
        """Keep this block's KV on disk: copied now, written by the writer thread."""
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return
            if block_hash in self._pending:
                return
            if len(self._pending) >= MAX_PENDING_WRITES:
                self.num_dropped += 1
                return
            self._pending[block_hash] = block.to("cpu", self.dtype, copy=True).contiguous()
        self._writes.put(block_hash)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until what was saved is written (tests, benchmarks); False if it took longer."""
        return waited(lambda: not self._pending, timeout_s)

    def _write_loop(self) -> None:
        while True:
            block_hash = self._writes.get()
            try:
                self._write(block_hash, self._pending[block_hash])
            except OSError as e:  # a full or failing disk: the block is not kept, the worker goes on
                log.warning("disk KV tier: could not write a block (%s)", e)
            finally:
                with self._lock:
                    self._pending.pop(block_hash, None)

    def _write(self, block_hash: int, block: torch.Tensor) -> None:
        with self._lock:
            while self._index and len(self._index) >= self.capacity:
                self._drop(next(iter(self._index)))
        data = block.view(torch.uint8).numpy().tobytes()
        path = self.dir / f"{block_hash:032x}.kv"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(self.MAGIC + zlib.crc32(data).to_bytes(4, "little") + len(data).to_bytes(4, "little") + data)
        os.replace(tmp, path)
        with self._lock:
            self._index[block_hash] = path
        self.num_written += 1

    def load(self, block_hash: int) -> torch.Tensor | None:
        """The block's KV, or None where its file is gone or does not check out (then deleted)."""
        with self._lock:
            path, pending = self._index.get(block_hash), self._pending.get(block_hash)
        if pending is not None:
            self.num_read += 1
            return pending.clone()
        if path is None:
            return None
        try:
            raw = path.read_bytes()
        except OSError:
            raw = b""
        head = len(self.MAGIC)
        data = raw[head + 8 :]
        if (raw[:head] != self.MAGIC or int.from_bytes(raw[head + 4 : head + 8], "little") != len(data)
                or len(data) != self.block_bytes or zlib.crc32(data) != int.from_bytes(raw[head : head + 4], "little")):
            with self._lock:
                if self._index.get(block_hash) == path:  # not let go meanwhile (its file then gone)
                    self.num_corrupt += 1
                    self._drop(block_hash)
            return None
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        self.num_read += 1
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype).view(self.shape)

    def _drop(self, block_hash: int) -> None:
        path = self._index.pop(block_hash)
        try:
            path.unlink()
        except OSError:
            pass
