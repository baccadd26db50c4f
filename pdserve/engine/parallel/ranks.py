"""Rank 0's side of a tensor-parallel worker: it starts the other ranks, joins them, and stops them.

The ranks meet through a file in a fresh directory only this user can read (no port listens
for strangers to join); gloo's own connections are on loopback. Each rank takes its share of the
worker's CPU threads. A rank dies with rank 0 (a thread watches its parent; a wait on a dead peer
raises), so the supervisor's one process is the whole worker.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

import torch

from pdserve.config import EngineConfig
from pdserve.engine.parallel.group import RankGroup, join

log = logging.getLogger("pdserve.parallel")

STOP_WAIT_S = 10.0
SHM_DIR = "/dev/shm"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One GPU per rank (cuda:0, cuda:1, ...); CPU ranks share the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def threads_per_rank(config: EngineConfig, size: int) -> int:
    return max(1, (config.num_threads or torch.get_num_threads()) // size)


def die_with_parent(period_s: float = 1.0) -> None:
    """Exit this process once the one that started it has (its parent changes): a thread watches."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        os._exit(1)

    threading.Thread(target=watch, name="watch-rank-0", daemon=True).start()


class Ranks:
    """Ranks 1..size-1 of this worker, started with `config` (its dtype resolved by rank 0)."""

    def __init__(self, config: EngineConfig, size: int) -> None:
        self.size = size
        # 0700; in shared memory where the host has it (the KV pool and the ranks' channel live
        # here too), named for this process so that the next worker reaps it if this one is killed
        where = SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()
        reap_stale(where)
        self.dir = Path(tempfile.mkdtemp(prefix=f"pdserve-tp-{os.getpid()}-", dir=where))
        self.rendezvous = str(self.dir / "rendezvous")
        threads = threads_per_rank(config, size)
        blob = json.dumps(dataclasses.asdict(dataclasses.replace(config, num_threads=threads)))
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, size):
            # stdout is the worker's own (a supervisor may read events there): a rank writes none
            proc = subprocess.Popen([sys.executable, "-m", "pdserve.engine.parallel.follower", str(rank), str(size),
                                     self.rendezvous], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
            proc.stdin.write(blob)
            proc.stdin.close()
            self.procs.append(proc)
        self.group: RankGroup | None = None
        self._finalizer = weakref.finalize(self, _end, self.procs, self.dir)

    def join(self, device: torch.device, hidden: int) -> RankGroup:
        """Rank 0 joins; returns once every rank has (they load the model first)."""
        self.group = join(0, self.size, self.rendezvous, rank_device(device, 0), hidden)
        return self.group

    def pool(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A KV pool every rank can map: a file in the ranks' directory (an engine whose worker gave
        it no file-backed pool of its own takes this one)."""
        path = self.dir / "kv"
        path.touch(mode=0o600)
        return torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype).view(shape)

    def share_pool(self, pool: torch.Tensor, num_blocks: int) -> None:
        """Tell the other ranks where the pool is; they map it and write their heads' layers there.
        On GPUs each rank keeps a cache of its own: they are told so (no path)."""
        path = pool.untyped_storage().filename if pool.is_cpu else ""
        if path is None:
            raise ValueError("a tensor-parallel worker's KV pool must live in a file every rank can map")
        self.group.send_pool(path, num_blocks)

    def stop(self) -> None:
        """Tell the ranks to stop, wait for them, and remove the rendezvous directory."""
        if self.group is not None and self.alive():
            try:
                self.group.send_stop()
                for p in self.procs:
                    p.wait(STOP_WAIT_S)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                log.warning("tensor-parallel ranks did not stop when told: %s", e)
        self._finalizer()

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)


def reap_stale(where: str) -> list[str]:
    """Remove the directories of tensor-parallel workers that are gone (killed before they could
    remove their own): `pdserve-tp-<pid>-*` whose process no longer runs."""
    removed = []
    for name in os.listdir(where):
        parts = name.split("-")
        if not (name.startswith("pdserve-tp-") and len(parts) >= 4 and parts[2].isdigit()):
            continue
        try:
            os.kill(int(parts[2]), 0)
            continue  # still running (or someone else's)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(os.path.join(where, name), ignore_errors=True)
        removed.append(name)
    return removed


def _end(procs: list[subprocess.Popen], directory: Path) -> None:
    """Kill the ranks still running (never told to stop: rank 0's engine was dropped) and clean up."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    shutil.rmtree(directory, ignore_errors=True)
