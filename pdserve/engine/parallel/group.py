"""The ranks of one tensor-parallel worker as a torch.distributed group (gloo on CPU, NCCL on
CUDA), and what rank 0 tells the others.

Rank 0 leads (its messages and the sums go through shared memory on a CPU where they fit:
`shm_reduce.py`). Once it has its KV pool (a file in shared memory on CPU, which every rank maps
and writes its own heads' layers into) it sends the pool's path and size. Before each step it
sends the step's plan (`step_plan`: per request its position, its new tokens, its block table:
what `ModelRunner` prepares a step from), and before each product of the head it sends the hidden
rows to multiply (prompt log-probabilities and samples alike), so the others run the same
collectives in the same order. Messages are int64 or float tensors
broadcast from rank 0: a header (command, sizes), then the payload. No pickled object crosses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.engine.parallel.lost import RanksLost
from pdserve.engine.parallel.shm_reduce import ShmChannel

STEP, LOGITS, STOP, POOL = 1, 2, 3, 4
JOIN_TIMEOUT_S = 300.0  # the ranks load the checkpoint before they join
SHM_ROWS = 2048  # rows of the largest all-reduce through shared memory (a default step's tokens)
SHM_BYTES = 64 << 20  # the most its slots take


def join(rank: int, size: int, rendezvous: str, device: torch.device, hidden: int = 0) -> RankGroup:
    """Join this worker's group: `rendezvous` is a file in a directory only this user can read.
    The group is a backend object of its own, not torch.distributed's default group: a process may
    hold several (tests run engines side by side). On a CPU, what fits `SHM_ROWS` rows of `hidden`
    goes through shared memory beside the rendezvous file (`shm_reduce.py`)."""
    store = dist.PrefixStore("pdserve-tp/", dist.FileStore(rendezvous, size))
    timeout = timedelta(seconds=JOIN_TIMEOUT_S)
    shm = None
    if device.type == "cuda":
        backend = dist.ProcessGroupNCCL(store, rank, size)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks talk over loopback only
        backend = dist.ProcessGroupGloo(store, rank, size, timeout)
        if hidden:
            rows = max(1, min(SHM_ROWS, SHM_BYTES // (2 * size * hidden * 4)))
            shm = ShmChannel(os.path.join(os.path.dirname(rendezvous), "channel"), rank, size, hidden, rows)
    return RankGroup(rank, size, device, backend, shm)


@dataclass
class RankGroup:
    rank: int
    size: int
    device: torch.device
    backend: object  # torch.distributed's ProcessGroupGloo or ProcessGroupNCCL
    shm: ShmChannel | None = None  # CPU ranks: what fits its slots goes through shared memory

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' partial sums added, in place (in their own dtype: half-precision partials are
        each rounded by their matmul already, so adding them in float32 changed nothing measured)."""
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        try:
            self.backend.allreduce([x]).wait()
        except RuntimeError as e:
            raise RanksLost(f"a tensor-parallel rank is gone: {e}") from None
        return x

    def logits(self, hidden: torch.Tensor, local_logits, vocab: int) -> torch.Tensor:
        """[rows, vocab] float32: each rank's vocabulary rows, gathered. Rank 0 sends the rows first."""
        if self.rank == 0:
            self._send(LOGITS, [hidden.shape[0], hidden.shape[1]])
            self._broadcast(hidden.contiguous())
        part = local_logits(hidden)
        width = -(-vocab // self.size)
        if part.shape[1] < width:  # the last rank's share is short: padded to gather, cut after
            part = torch.nn.functional.pad(part, (0, width - part.shape[1]))
        part = part.contiguous()
        if self.shm is not None and self.shm.fits(part):
            return torch.cat(self.shm.all_gather(part), dim=1)[:, :vocab]
        parts = [torch.empty_like(part) for _ in range(self.size)]
        try:
            self.backend.allgather([parts], [part]).wait()
        except RuntimeError as e:
            raise RanksLost(f"a tensor-parallel rank is gone: {e}") from None
        return torch.cat(parts, dim=1)[:, :vocab]

    def send_step(self, plan: list[int]) -> None:
        self._send(STEP, [len(plan)])
        self._broadcast(torch.tensor(plan, dtype=torch.int64, device=self.device))

    def send_pool(self, path: str, num_blocks: int) -> None:
        data = path.encode()
        self._send(POOL, [len(data), num_blocks])
        self._broadcast(torch.tensor(list(data), dtype=torch.uint8, device=self.device))

    def send_stop(self) -> None:
        self._send(STOP, [])

    def receive(self, dtype: torch.dtype) -> tuple[int, object]:
        """(command, payload) from rank 0, on the other ranks."""
        header = self._broadcast(torch.zeros(4, dtype=torch.int64, device=self.device))
        command, sizes = int(header[0]), header[1:].tolist()
        if command == STEP:
            return command, self._broadcast(torch.empty(sizes[0], dtype=torch.int64, device=self.device))
        if command == LOGITS:
            return command, self._broadcast(torch.empty(sizes[0], sizes[1], dtype=dtype, device=self.device))
        if command == POOL:  # (path, number of blocks)
            path = self._broadcast(torch.empty(sizes[0], dtype=torch.uint8, device=self.device))
            return command, (bytes(path.tolist()).decode(), sizes[1])
        return command, None

    def _send(self, command: int, sizes: list[int]) -> None:
        self._broadcast(torch.tensor([command, *sizes, *[0] * (3 - len(sizes))], dtype=torch.int64,
                                     device=self.device))

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        if self.shm is not None and self.shm.fits(t):
            return self.shm.broadcast(t)
        try:
            self.backend.broadcast(t, 0).wait()
        except RuntimeError as e:
            raise RanksLost(f"a tensor-parallel rank is gone: {e}") from None
        return t
