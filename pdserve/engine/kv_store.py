"""A KV tier several workers share (`--kv-store URL`): prefix blocks in a Valkey (or Redis) server,
on this host (`pdserve serve --local-kv-store SIZE` starts one on a private unix socket) or
another. Valkey, measured against Mooncake Store on the machines this project runs on (2 vCPUs,
loopback): a 1 MiB value in about 0.5-0.8 ms either way over a unix socket or TCP; Valkey starts
in 50 ms with 6 MB of memory and listens only where told, where Mooncake's store needs the RDMA
verbs library even for TCP, takes a second to start, and binds some of its ports to every address.

1. A full block a step computed goes here at once (so other workers read it rather than compute it
   while it is still in this pool), and a block the pool evicts (one that came by transfer, or was
   not sent): the engine thread copies it out and a writer thread sends it, `SET` under a key
   named by the KV layout and the block's prefix hash. What waits to be sent is bounded
   (`MAX_PENDING_BYTES`); past it a block is not sent (counted), so a slow store never stalls a step.
   A block sent lately is not sent again.
2. A request whose prefix neither the pool nor the host tier (nor the disk) holds asks here for
   the blocks after them: pipelined `GET`s of `MAX_READ_BLOCKS` a round trip, on the engine thread
   (a block of the default model is 368 KB). Every value carries the KV layout's key, its length and CRC-32: one that does not
   check out is deleted and its block computed again, never served.
3. The server bounds itself (`maxmemory`, least recently used out first). A store that fails
   (down, slow past `TIMEOUT_S`) is left alone for `BACKOFF_S`: the worker goes on without it and
   says so in its log and its counters.

The password, if any, comes from `PDSERVE_KV_STORE_PASSWORD`, never from a command line.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
import zlib
from collections import OrderedDict

import torch

from pdserve.engine.tier_prefetch import waited
from pdserve.store_server import PASSWORD_ENV, parse_store_url

log = logging.getLogger("pdserve.engine")

MAGIC = b"PDSKV2\0\0"
MAX_PENDING_BYTES = 128 << 20
MAX_READ_BLOCKS = 64
RECENTLY_SENT = 65536  # block hashes remembered as sent: not sent again
TIMEOUT_S = 2.0
BACKOFF_S = 5.0


class StoreKVTier:
    """The client side of a shared KV tier for one pool's blocks (`block`: one of them, for its
    shape and dtype); `layout_key` names the model and layout, so workers of another model or
    layout never read these blocks."""

    def __init__(self, url: str, layout_key: str, block: torch.Tensor) -> None:
        import valkey  # the `store` extra

        self.url, self.layout_key = url, layout_key
        self.shape, self.dtype = tuple(block.shape), block.dtype
        self.block_bytes = block.numel() * block.element_size()
        self.client = valkey.Valkey(**parse_store_url(url), password=os.environ.get(PASSWORD_ENV) or None,
                                    socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
        self._errors = (valkey.ValkeyError, OSError)
        self._header = MAGIC + layout_key.encode()[:64].ljust(64, b"\0")
        self._pending: queue.Queue = queue.Queue()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._sent: OrderedDict[int, None] = OrderedDict()
        self._down_until = 0.0
        self.num_written = self.num_read = self.num_corrupt = self.num_dropped = self.num_errors = 0
        self.num_from_store = 0
        threading.Thread(target=self._send_loop, name="kv-store-writer", daemon=True).start()

    @property
    def identity(self) -> str:
        """The same for every worker that reaches this store: its URL (a socket's path, on this host)."""
        where = self.url + (f"@{os.uname().nodename}" if self.url.startswith("unix:") else "")
        return hashlib.sha256(where.encode()).hexdigest()[:16]

    def stats(self) -> dict:
        return {"kv_store": self.identity, "kv_store_blocks_written": self.num_written,
                "kv_store_blocks_read": self.num_read, "kv_store_blocks_corrupt": self.num_corrupt,
                "kv_store_blocks_dropped": self.num_dropped, "kv_store_errors": self.num_errors}

    def key(self, block_hash: int) -> bytes:
        return f"pdserve:kv:{self.layout_key}:{block_hash:032x}".encode()

    # -- writes (the engine thread queues, the writer sends) --------------------------------------

    def save(self, block_hash: int, block: torch.Tensor) -> None:
        """Keep this block's KV in the store (copied now; sent by the writer thread)."""
        with self._lock:
            if block_hash in self._sent or self._pending_bytes + self.block_bytes > MAX_PENDING_BYTES:
                if block_hash not in self._sent:
                    self.num_dropped += 1
                return
            self._sent[block_hash] = None
            while len(self._sent) > RECENTLY_SENT:
                self._sent.popitem(last=False)
            self._pending_bytes += self.block_bytes
        self._pending.put((block_hash, block.to("cpu", self.dtype, copy=True).contiguous()))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until what was queued is sent (tests, benchmarks); False if it took longer."""
        return waited(lambda: self._pending_bytes == 0, timeout_s)

    def _send_loop(self) -> None:
        while True:
            block_hash, block = self._pending.get()
            data = block.view(torch.uint8).numpy().tobytes()
            value = self._header + zlib.crc32(data).to_bytes(4, "little") + len(data).to_bytes(4, "little") + data
            try:
                if time.monotonic() >= self._down_until:
                    self.client.set(self.key(block_hash), value)
                    self.num_written += 1
            except self._errors as e:
                self._failed("write", e)
                with self._lock:
                    self._sent.pop(block_hash, None)
            finally:
                with self._lock:
                    self._pending_bytes -= self.block_bytes

    # -- reads (engine thread) -----------------------------------------------------------------

    def load_run(self, hashes: list[int]) -> list[torch.Tensor]:
        """The KV of the leading blocks of `hashes` the store holds, up to the first it lacks (or
        that does not check out): `MAX_READ_BLOCKS` a round trip."""
        blocks: list[torch.Tensor] = []
        while len(blocks) < len(hashes) and time.monotonic() >= self._down_until:
            ask = hashes[len(blocks):len(blocks) + MAX_READ_BLOCKS]
            try:
                values = self.client.mget([self.key(h) for h in ask])
            except self._errors as e:
                self._failed("read", e)
                break
            for block_hash, value in zip(ask, values):
                block = self._checked(block_hash, value) if value is not None else None
                if block is None:
                    with self._lock:  # the store let it go (or it failed its checks): send it again when computed
                        self._sent.pop(block_hash, None)
                    self.num_read += len(blocks)
                    return blocks
                blocks.append(block)
        self.num_read += len(blocks)
        return blocks

    def _checked(self, block_hash: int, value: bytes) -> torch.Tensor | None:
        head = len(self._header)
        data = memoryview(value)[head + 8:]
        if (value[:head] != self._header or int.from_bytes(value[head + 4:head + 8], "little") != len(data)
                or len(data) != self.block_bytes or zlib.crc32(data) != int.from_bytes(value[head:head + 4], "little")):
            self.num_corrupt += 1
            log.warning("KV store: block %032x does not check out: deleted, computed again", block_hash)
            try:
                self.client.delete(self.key(block_hash))
            except self._errors as e:
                self._failed("delete", e)
            return None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype).view(self.shape)  # one copy

    def _failed(self, what: str, e: Exception) -> None:
        self.num_errors += 1
        if time.monotonic() >= self._down_until:
            log.warning("KV store %s: %s failed (%s: %s); going on without it for %.0f s", self.url, what,
                        type(e).__name__, e, BACKOFF_S)
        self._down_until = time.monotonic() + BACKOFF_S
