"""The decode step as one compiled graph: `torch.compile` (inductor: C++ on CPU, Triton on CUDA)
over the model's forward and its logits, with attention one opaque operator per layer.

At the sizes pdserve serves on a CPU a decode step is overhead-bound: each layer runs about fifteen
operators, and dispatching one costs more than the arithmetic of a small batch. Compiled, norms,
residual adds, rotary and SiLU-times-up become a few fused loops around the matmuls.

- Only decode-only steps take this path (one token per row, every row sampled, no per-layer
  callback); prefill chunks are matmul-bound, and their shapes vary.
- The token count is a dynamic size: one graph for batch 1 (torch specializes it) and one for
  every larger batch. Context lengths and block tables never reach the graph (the attention
  operator reads them, and the KV cache, from `step_metadata`), so they cause no recompiles, and
  the compiler sees no cache writes to order.
- Compiled code is cached on disk (inductor's cache, under pdserve's cache directory unless
  TORCHINDUCTOR_CACHE_DIR says otherwise): a restart pays seconds, not the first compile.
- A compile that fails is logged once, and the engine goes on eager.

Off by default (`--compile-decode` turns it on): measured on a 2-vCPU AMD EPYC (AVX-512) with the
default model at batch 1, it runs as fast as eager in float32 (20.2 against 20.8 tok/s) and cannot
yet trace bfloat16 weights kept in oneDNN's packed layout (it falls back to eager).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from pdserve.layers.attention import AttentionMetadata, step_metadata
from pdserve.models.llama import LlamaForCausalLM

log = logging.getLogger("pdserve.engine")


def inductor_cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "pdserve" / "inductor"


class CompiledDecode:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor) -> None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
        self.model = model
        self.kv_cache = kv_cache
        self.failed = False
        # freezing: weights are constants, packed once for the fastest kernels
        self._compiled = torch.compile(self._logits, dynamic=True, fullgraph=True, options={"freezing": True})

    def _logits(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, None, None))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                 ) -> torch.Tensor | None:
        """[rows, vocab] float32 logits, or None if this model cannot be compiled (then never again)."""
        if self.failed:
            return None
        try:
            with step_metadata(meta, self.kv_cache):
                return self._compiled(input_ids, positions)
        except torch._dynamo.exc.TorchDynamoException:
            log.exception("compiling the decode step failed; this engine runs eager from now on")
            self.failed = True
            return None
