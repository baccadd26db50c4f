"""Same-host KV transfer: the decode worker's KV pool lives in shared memory, prefill copies into it.

The decode worker creates its cache as a file under /dev/shm (`SharedKVPool`) and offers its path
on its control endpoint. A prefill worker maps it (only a pdserve pool file of exactly the
expected size is accepted), CLAIMs each lease over the socket before its first copy (the decode
worker confirms the lease is still open and binds it to this peer), copies each layer's slots in
place, and reports every copy with a payload-free "direct" WRITE. Aborts and notifies are the same
frames as over tcp.
"""

from __future__ import annotations

import os
import re
import secrets

import torch

from pdserve.kv_transfer.base import KVLayout, TransferError
from pdserve.wire import SHM_DIR, SHM_POOL_NAME
from pdserve.kv_transfer.quant import gather_slots
from pdserve.kv_transfer.in_place import InPlaceSender

POOL_NAME = re.compile(SHM_POOL_NAME)


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def reap_stale_pools() -> list[str]:
    """Remove pool files (and a durable pool's journal) whose owner is gone: a decode worker killed
    before it could remove its own, or a durable pool's supervisor."""
    removed = []
    for name in os.listdir(SHM_DIR):
        if not POOL_NAME.match(name.replace("pdserve-kvj-", "pdserve-kv-", 1).removesuffix(".tmp")):
            continue
        pid = int(name.split("-")[2])
        try:
            os.kill(pid, 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # someone else's live process
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:
            pass
    return removed


class SharedKVPool:
    """A KV cache tensor backed by a shared-memory file, removed again by `close()` (or, if the
    process is killed, by the next pool made on this host)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        reap_stale_pools()
        self.path = os.path.join(SHM_DIR, f"pdserve-kv-{os.getpid()}-{secrets.token_hex(8)}")
        numel = 1
        for d in shape:
            numel *= d
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        self.tensor = torch.from_file(self.path, shared=True, size=numel, dtype=dtype).view(shape)

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def map_peer_pool(path: str, layout: KVLayout, num_slots: int) -> torch.Tensor:
    """The decode worker's pool, mapped here; refuses anything but a pdserve pool of the right size."""
    try:
        real = os.path.realpath(path)
    except (OSError, ValueError):  # ValueError: a NUL byte, or a name the file system cannot encode
        real = ""
    if os.path.dirname(real) != SHM_DIR or not POOL_NAME.match(os.path.basename(real)):
        raise TransferError(f"{path!r} is not a pdserve shared KV pool")
    shape = (layout.num_layers, num_slots, 2, layout.num_kv_heads, layout.head_dim)
    numel = layout.num_layers * num_slots * 2 * layout.num_kv_heads * layout.head_dim
    try:
        size = os.path.getsize(real)
    except OSError as e:
        raise TransferError(f"cannot open the decode worker's shared KV pool: {e}") from None
    if size != numel * layout.torch_dtype.itemsize:
        raise TransferError(f"shared KV pool {path!r} has {size} bytes, its layout needs {numel * layout.torch_dtype.itemsize}")
    return torch.from_file(real, shared=True, size=numel, dtype=layout.torch_dtype).view(shape)


class ShmSender(InPlaceSender):
    backend = "shm"

    def _setup(self, peer: dict) -> None:
        super()._setup(peer)
        path, num_slots = peer.get("path"), peer.get("num_slots")
        if not isinstance(path, str) or type(num_slots) is not int or num_slots < 1:
            raise TransferError(f"bad shm offer from the decode worker: path {path!r}, num_slots {num_slots!r}")
        self.peer_kv = map_peer_pool(path, self.layout, num_slots)
        self.peer_slots = self.peer_kv.shape[1]

    def _copy(self, layers: range, src_runs: list[tuple[int, int]], dst_runs: list[tuple[int, int]]) -> int:
        if self.own_layout.ranks == self.layout.ranks:
            src = gather_slots(self.kv_cache[layers.start : layers.stop], slice(None), src_runs)
        else:  # the peer's ranks hold other splits of the heads: each of its layers gathered
            src = torch.stack([self._gather(self.kv_cache, layer, src_runs) for layer in layers])
        offset = 0
        for slot, n in dst_runs:
            self.peer_kv[layers.start : layers.stop, slot : slot + n].copy_(src[:, offset : offset + n])
            offset += n
        return src.numel() * src.element_size()
