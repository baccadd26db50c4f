"""`pdserve worker --standby`: a worker process that loads its model before it is needed, then waits
for its supervisor to tell it to go on (a line on stdin) as the worker it stands in for, which has
exited. Going on, it builds only what a loaded model leaves: the KV pool (a durable one mapped and
checked then, once the worker before it is gone), the engine, its endpoint; no warm-up where KV
waits to resume. Its supervisor gone (stdin closed), it exits."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from pdserve.config import EngineConfig, resolve_device

log = logging.getLogger("pdserve.worker")


def stand_by(config: EngineConfig) -> bool:
    """Preload `config`'s model, say so on stdout, wait. True: go on; False: the supervisor left."""
    import torch

    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.model_load import preload

    t0 = time.perf_counter()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)  # as the engine will: measured choices are per thread count
    loaded = preload(config, resolve_device(config.device), LLMEngine)
    from pdserve.structure import Grammars  # its engine's structured outputs find this built

    Grammars(loaded.checkpoint.tokenizer, loaded.arch.vocab_size, loaded.eos_token_ids()).prepare()
    log.info("standby: model loaded in %.2f s; waiting to stand in", time.perf_counter() - t0)
    print(json.dumps({"event": "standby", "pid": os.getpid(), "load_seconds": round(time.perf_counter() - t0, 2)}),
          flush=True)
    said = sys.stdin.readline()
    if said.strip() != "go":
        log.info("standby: the supervisor is gone; exiting")
        return False
    log.info("standby: standing in")
    return True
