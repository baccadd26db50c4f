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
import threading

import torch

from pdserve.kv_transfer.base import KVLayout, Lease, TransferError
from pdserve.kv_transfer.codec import AckHeader, ClaimHeader, WriteHeader, encode_frame
from pdserve.kv_transfer.quant import gather_slots
from pdserve.kv_transfer.tcp import TcpSender

SHM_DIR = "/dev/shm"
_POOL_NAME = re.compile(r"^pdserve-kv-\d+-[0-9a-f]{16}$")
CLAIM_TIMEOUT_S = 10.0


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


class SharedKVPool:
    """A KV cache tensor backed by a shared-memory file, removed again by `close()`."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
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
    real = os.path.realpath(path)
    if os.path.dirname(real) != SHM_DIR or not _POOL_NAME.match(os.path.basename(real)):
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


class ShmSender(TcpSender):
    backend = "shm"

    def _setup(self, peer: dict) -> None:
        if self.encoding != "raw":
            raise TransferError("shared-memory transfer copies the cache's own dtype; drop --kv-transfer-dtype")
        self.peer_kv = map_peer_pool(str(peer.get("path", "")), self.layout, int(peer.get("num_slots", 0)))
        self._claims: dict[int, threading.Event] = {}
        self._claimed: dict[int, bool] = {}

    def _write(self, lease: Lease, layer: int, start: int, end: int, src_runs: list[tuple[int, int]]) -> None:
        if not self._claim(lease):
            return
        src = gather_slots(self.kv_cache, layer, src_runs)
        offset = 0
        for slot, n in lease.slot_runs(start, end):
            self.peer_kv[layer, slot : slot + n].copy_(src[offset : offset + n])
            offset += n
        self._send(encode_frame(WriteHeader(lease.request_id, lease.fence, layer, start, end - start, "direct")))
        self.bytes_sent += src.numel() * src.element_size()

    def _claim(self, lease: Lease) -> bool:
        if lease.fence in self._claimed:
            return self._claimed[lease.fence]
        event = self._claims.setdefault(lease.fence, threading.Event())
        self._send(encode_frame(ClaimHeader(lease.request_id, lease.fence)))
        if not event.wait(CLAIM_TIMEOUT_S):
            raise TransferError(f"the decode worker did not answer the claim of lease {lease.fence}")
        ok = self._claimed.get(lease.fence, False)
        if not ok:
            self._aborted_fences.add(lease.fence)
        return ok

    def _forget_lease(self, lease: Lease) -> None:
        self._claimed.pop(lease.fence, None)

    def _on_ack(self, ack: AckHeader) -> None:
        event = self._claims.pop(ack.fence, None)
        if event is not None:
            self._claimed[ack.fence] = ack.ok
            event.set()

    def close(self) -> None:
        super().close()
        for event in list(self._claims.values()):
            event.set()
