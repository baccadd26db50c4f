"""KV transfer through NVIDIA NIXL (UCX): one-sided WRITEs into the decode worker's registered pool.

This is the path GPU clusters take (RDMA, NVLink through UCX); on CPU hosts UCX moves DRAM over
shared memory or TCP. Each worker process has one NIXL agent with its whole KV cache registered.
A decode worker offers its agent's metadata (NIXL's own binary format, base64 in JSON) and the
pool's base address on its control endpoint; a prefill worker adds it as a remote agent (a
bounded set, `RemoteAgents`, shared by its senders: decode workers come and go) and,
after CLAIMing a lease over the frame socket, WRITEs each layer's slot runs straight into the
decode pool, reporting each write with a "direct" frame (see `InPlaceSender`).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import secrets
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.kv_transfer.base import TransferError
from pdserve.kv_transfer.in_place import InPlaceSender

XFER_TIMEOUT_S = 30.0
MAX_REMOTE_AGENTS = 64
_agents: dict[int, _Agent] = {}
_agents_lock = threading.Lock()


PROGRESS_DELAY_US = 1000


def _nixl_api():
    try:
        from nixl import _api
    except ImportError:
        from nixl_cu12 import _api
    _quiet_nixl_logging()
    return _api


def _quiet_nixl_logging() -> None:
    """NIXL logs every agent at INFO to stdout, where a worker prints its ready line: keep its
    warnings, on stderr (NIXL_LOG_LEVEL still wins)."""
    logger = logging.getLogger("nixl")
    if not os.getenv("NIXL_LOG_LEVEL"):
        logger.setLevel(logging.WARNING)
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


@contextlib.contextmanager
def _progress_thread_delay(api, delay_us: int):
    """NIXL's Python API starts its progress thread with no delay between polls, which keeps a
    core busy: prefill ran 3x slower next to it on a 2-core host. Without the thread, a target
    never progresses and writes into it stall. So agents are made with the thread polling every
    `delay_us` (measured: no slowdown of compute, 3.6 GB/s for a 64 MB write)."""
    binding = api.nixlBind
    original = binding.nixlAgentConfig

    class DelayedProgress(original):
        def __setattr__(self, name, value):
            super().__setattr__(name, delay_us if name == "pthrDelay" else value)

    binding.nixlAgentConfig = DelayedProgress
    try:
        yield
    finally:
        binding.nixlAgentConfig = original


def nixl_available() -> bool:
    try:
        _nixl_api()
    except ImportError:
        return False
    return True


class RemoteAgentAPI(Protocol):
    """The part of a NIXL agent that adds and removes remote agents."""

    def add_remote_agent(self, metadata: bytes) -> bytes | str: ...

    def remove_remote_agent(self, name: str) -> None: ...


@dataclass(slots=True)
class _Remote:
    name: str
    users: int = 0  # senders holding it


class RemoteAgents:
    """The remote agents a local agent knows, by their metadata, each with the number of senders
    using it. At most `capacity`: adding one past it removes the least recently used agent that
    no sender uses, and if every one is in use the new one is refused (TransferError), so the
    prefill worker falls back to its next backend. Thread-safe."""

    def __init__(self, agent: RemoteAgentAPI, capacity: int = MAX_REMOTE_AGENTS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.agent = agent
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, _Remote] = OrderedDict()  # by metadata, least recently used first

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def acquire(self, metadata: bytes) -> str:
        """The remote agent's name, added if new; pair with one `release(metadata)`."""
        with self._lock:
            entry = self._entries.get(metadata)
            if entry is None:
                if len(self._entries) >= self.capacity:
                    self._evict_one()
                name = self.agent.add_remote_agent(metadata)  # bytes from the binding
                entry = self._entries[metadata] = _Remote(name.decode() if isinstance(name, bytes) else name)
            self._entries.move_to_end(metadata)
            entry.users += 1
            return entry.name

    def release(self, metadata: bytes) -> None:
        with self._lock:
            entry = self._entries.get(metadata)
            if entry is not None and entry.users > 0:
                entry.users -= 1
                self._entries.move_to_end(metadata)  # its last use ended now

    def clear(self) -> None:
        with self._lock:
            for entry in self._entries.values():
                self.agent.remove_remote_agent(entry.name)
            self._entries.clear()

    def _evict_one(self) -> None:
        """Called under the lock."""
        for metadata, entry in self._entries.items():
            if entry.users == 0:
                del self._entries[metadata]
                self.agent.remove_remote_agent(entry.name)
                return
        raise TransferError(f"NIXL already talks to {self.capacity} decode workers, all with transfers in use")


class _Agent:
    """This process's NIXL agent, with the KV cache registered once."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        api = _nixl_api()
        self.name = f"pdserve-{os.getpid()}-{secrets.token_hex(4)}"
        with _progress_thread_delay(api, PROGRESS_DELAY_US):
            self.agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=["UCX"]))
        if "UCX" not in self.agent.backends:
            raise TransferError("NIXL has no UCX backend on this machine")
        self.kv_cache = kv_cache
        self.mem = "VRAM" if kv_cache.is_cuda else "DRAM"
        self.device_id = kv_cache.device.index or 0
        self.registration = self.agent.register_memory(self.agent.get_reg_descs([kv_cache]))
        self.remotes = RemoteAgents(self.agent)
        self.lock = threading.Lock()

    def offer(self) -> dict:
        return {
            "agent_metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "base_addr": self.kv_cache.data_ptr(),
            "num_slots": self.kv_cache.shape[1],
            "mem": self.mem,
            "device_id": self.device_id,
        }

    def close(self) -> None:
        """Tear the agent down now, on this thread (left to interpreter exit, UCX aborts)."""
        with self.lock:
            self.remotes.clear()
            self.agent.deregister_memory(self.registration)
            self.agent.agent = None  # the binding's destructor joins NIXL's threads here


def local_agent(kv_cache: torch.Tensor) -> _Agent:
    with _agents_lock:
        agent = _agents.get(kv_cache.data_ptr())
        if agent is None:
            agent = _agents[kv_cache.data_ptr()] = _Agent(kv_cache)
        return agent


def release_agent(kv_cache: torch.Tensor) -> None:
    """Drop this cache's agent (deregistering its memory) before the cache goes away."""
    with _agents_lock:
        agent = _agents.pop(kv_cache.data_ptr(), None)
    if agent is not None:
        agent.close()


def paired_runs(src: list[tuple[int, int]], dst: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Cut two run lists of equal total length at each other's boundaries: (src, dst, count)."""
    out, i, j, si, dj = [], 0, 0, 0, 0
    while i < len(src) and j < len(dst):
        n = min(src[i][1] - si, dst[j][1] - dj)
        out.append((src[i][0] + si, dst[j][0] + dj, n))
        si, dj = si + n, dj + n
        if si == src[i][1]:
            i, si = i + 1, 0
        if dj == dst[j][1]:
            j, dj = j + 1, 0
    return out


class NixlSender(InPlaceSender):
    backend = "nixl"

    def _setup(self, peer: dict) -> None:
        super()._setup(peer)
        if not nixl_available():
            raise TransferError("NIXL is not installed (pip install 'pdserve[nixl]')")
        if self.layout.ranks != self.own_layout.ranks:  # a raw copy of slot ranges cannot re-split heads
            raise TransferError(f"NIXL copies KV between pools of as many tensor-parallel ranks; this worker has "
                                f"{self.own_layout.ranks}, the decode worker {self.layout.ranks}")
        try:
            metadata = base64.b64decode(peer["agent_metadata"], validate=True)
            self.peer_base = int(peer["base_addr"])
            self.peer_slots = int(peer["num_slots"])
            self.peer_mem = str(peer.get("mem", "DRAM"))
            self.peer_device = int(peer.get("device_id", 0))
        except (KeyError, ValueError, TypeError, OverflowError) as e:  # OverflowError: int(inf)
            raise TransferError(f"bad NIXL offer from the decode worker: {e}") from None
        if self.peer_mem not in ("DRAM", "VRAM"):
            raise TransferError(f"bad NIXL memory type {self.peer_mem!r}")
        self.nixl = local_agent(self.kv_cache)
        try:
            self.peer_agent = self.nixl.remotes.acquire(metadata)
        except TransferError:
            raise
        except Exception as e:  # NIXL raises its own error types
            raise TransferError(f"NIXL could not add the decode worker's agent: {e}") from None
        self._peer_metadata = metadata

    def _teardown(self) -> None:
        self.nixl.remotes.release(self._peer_metadata)

    def _copy(self, layers: range, src_runs: list[tuple[int, int]], dst_runs: list[tuple[int, int]]) -> int:
        slot_bytes = self.layout.slot_bytes
        pieces = paired_runs(src_runs, dst_runs)
        local, remote = [], []
        for layer in layers:
            local_base = self.kv_cache.data_ptr() + layer * self.kv_cache.shape[1] * slot_bytes
            peer_base = self.peer_base + layer * self.peer_slots * slot_bytes
            local += [(local_base + s * slot_bytes, n * slot_bytes, self.nixl.device_id) for s, _, n in pieces]
            remote += [(peer_base + d * slot_bytes, n * slot_bytes, self.peer_device) for _, d, n in pieces]
        agent = self.nixl.agent
        handle = agent.initialize_xfer(
            "WRITE", agent.get_xfer_descs(local, self.nixl.mem), agent.get_xfer_descs(remote, self.peer_mem),
            self.peer_agent)
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + XFER_TIMEOUT_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError("NIXL write timed out")
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"NIXL write failed ({state})")
        finally:
            agent.release_xfer_handle(handle)
        return sum(n for _, n, _ in local)
