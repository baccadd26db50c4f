"""A tensor-parallel rank other than 0: builds its shard of the worker's model and KV cache, joins
the worker's group, then runs what rank 0 sends until told to stop or rank 0 is gone.

Its KV cache is its heads' layers in rank 0's pool (`POOL`, first after joining), so what rank 0
ships, keeps in a tier or journals holds every rank's heads. Started by rank 0 (`ranks.Ranks`) as
`python -m pdserve.engine.parallel.follower RANK SIZE RENDEZVOUS`, the engine config (its dtype
and quantization as rank 0 resolved them) as JSON on stdin.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys

import torch

from pdserve.config import EngineConfig, resolve_device, resolve_dtype
from pdserve.engine.parallel.group import LOGITS, POOL, STEP, STOP, join
from pdserve.engine.parallel.lost import RanksLost
from pdserve.engine.parallel.ranks import die_with_parent, rank_device
from pdserve.engine.step_plan import planned_step
from pdserve.models.shard import Shard

log = logging.getLogger("pdserve.parallel")


def serve_rank(rank: int, size: int, rendezvous: str, config: EngineConfig) -> None:
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.models.loader import build_model, load_checkpoint

    device = rank_device(resolve_device(config.device), rank)
    dtype = resolve_dtype(config.dtype, device)
    model = build_model(load_checkpoint(config.model), dtype, device, config.quantization,
                        shard=Shard(rank, size, config.expert_parallel))
    group = join(rank, size, rendezvous, device, model.cfg.hidden_size)
    model.join(group)
    command, pool = group.receive(dtype)
    if command != POOL:
        raise RuntimeError(f"tensor-parallel rank {rank}: expected the KV pool first, got command {command}")
    path, num_blocks = pool
    runner = ModelRunner(model, num_blocks, config.block_size, dtype, device, config.seed,
                         kv_allocator=(lambda shape, dtype: map_pool(path, shape, dtype)) if path else None)
    while True:
        command, payload = group.receive(dtype)
        if command == STEP:
            runner.run_layers(planned_step(payload.tolist()))
        elif command == LOGITS:
            with torch.inference_mode():
                model.compute_logits(payload)
        elif command == STOP:
            return


def main() -> None:
    rank, size, rendezvous = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    die_with_parent()
    config = EngineConfig(**json.loads(sys.stdin.read()))
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    try:
        serve_rank(rank, size, rendezvous, config)
    except RanksLost:
        log.warning("tensor-parallel rank %d: rank 0 is gone; stopping", rank)


def map_pool(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank 0's KV pool, mapped here (the size the shape implies, or an error)."""
    numel = math.prod(shape)
    if os.path.getsize(path) != numel * dtype.itemsize:
        raise RuntimeError(f"the KV pool {path} has {os.path.getsize(path)} bytes; this rank expects "
                           f"{numel * dtype.itemsize}")
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


if __name__ == "__main__":
    main()
