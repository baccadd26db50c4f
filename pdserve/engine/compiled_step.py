"""The decode step as one compiled graph: `torch.compile` (inductor: C++ on CPU, Triton on CUDA)
over the model's forward and its logits, with attention one opaque operator per layer.

At the sizes pdserve serves on a CPU a decode step is overhead-bound: each layer runs about fifteen
operators, and dispatching one costs more than the arithmetic of a small batch; oneDNN's bf16
matmul alone spends ~70 us of framework time per call around a ~20 us kernel. Compiled, norms,
residual adds, rotary and SiLU-times-up become a few fused loops, and the matmuls run inductor's
C++ GEMM templates on weights packed once (AMX micro-kernels where the CPU has them, AVX-512 or
AVX2 otherwise), chosen by benchmarking each shape against oneDNN (`max_autotune`).

- Only decode-only steps take this path (one token per row, every row sampled, no per-layer
  callback); prefill chunks are matmul-bound, and their shapes vary.
- Two graphs: one for a single row (torch specializes size 1) and one for any larger batch (the
  batch a dynamic size; the C++ GEMM templates take it as such). Context lengths and block tables
  never reach a graph (the attention operator reads them, and the KV cache, from
  `step_metadata`), so they cause no recompiles.
- Weights are frozen into the graph (inductor's `freezing`): the model must hold them as plain
  tensors (`build_model(pack_weights=False)`), not in oneDNN's opaque layout.
- Both compile on a thread of their own from the engine's start (single rows first); until a
  graph is ready its steps run eager, so no request waits for a compile (`warm_up()` waits).
  Frozen graphs bypass inductor's graph cache: every process start compiles again (the C++ builds
  and autotuning choices are cached on disk, under pdserve's cache directory unless
  TORCHINDUCTOR_CACHE_DIR says otherwise). On a 2-vCPU Xeon a graph of the default model takes
  ~75-85 s (~145 s the first time on a machine).
- A compile that fails is logged once, and the engine goes on eager.
- Dense weights only: quantized ones run pdserve's kernels through ctypes, which a graph cannot
  hold (the engine then decodes eager and says so). That is also why this is not the default on a
  CPU: the default model's 4-bit weights decode eager at 172 tok/s for one stream on a 2-vCPU Xeon
  with AMX, these graphs over its dense bfloat16 weights at 65 (eager dense: 48), and at 16 rows
  all three are level (~600 tok/s).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch

from pdserve.cache import cache_path
from pdserve.layers.attention import AttentionMetadata, step_metadata
from pdserve.models.llama import LlamaForCausalLM

log = logging.getLogger("pdserve.engine")


def inductor_cache_dir() -> Path:
    return cache_path("inductor")


def graph_key(rows: int) -> int:
    """Which graph runs a batch of `rows`: 1 (single rows) or 2 (any larger batch)."""
    return 1 if rows == 1 else 2


def _inductor_options(device: torch.device) -> dict:
    options = {"freezing": True}
    if device.type == "cpu":  # C++ GEMM templates against oneDNN, benchmarked per shape
        options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
    return options


class _DecodeGraph(torch.nn.Module):
    """The module compiled: parameters of a module are what freezing turns into constants."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, None, None))


class CompiledDecode:
    """The compiled decode graphs, compiled on a thread of their own while steps run eager
    (`__call__` returns None until a step's graph is ready): a server never stalls on a compile."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor) -> None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.failed = False
        self.num_steps = 0  # steps run compiled
        self._options = _inductor_options(self.device)
        # two graphs, counted apart from other engines' graphs of the same code
        self._compiled = torch.compile(_DecodeGraph(model), dynamic=True, fullgraph=True,
                                       recompile_limit=2, isolate_recompiles=True)
        self._ready: set[int] = set()
        threading.Thread(target=self._compile_all, name="decode-compiler", daemon=True).start()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                 ) -> torch.Tensor | None:
        """[rows, vocab] float32 logits, or None when this step runs eager: its graph is still
        compiling, or the model cannot be compiled."""
        key = graph_key(input_ids.shape[0])
        if self.failed or key not in self._ready:
            return None
        with step_metadata(meta, self.kv_cache):
            logits = self._compiled(input_ids, positions)
        self.num_steps += 1
        return logits

    def warm_up(self, timeout: float | None = None) -> bool:
        """Wait until both graphs are compiled; False if the model cannot be compiled or `timeout`
        passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.failed and len(self._ready) < 2:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return not self.failed

    def _compile_all(self) -> None:
        for key in (1, 2):  # single rows first: every engine decodes some alone
            t0 = time.perf_counter()
            try:
                # inputs made as the engine makes its own (inference tensors): the same guards
                with torch.inference_mode(), torch._inductor.config.patch(self._options):
                    ids = torch.zeros(key, dtype=torch.long, device=self.device)
                    empty = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long, device=self.device),
                                              block_size=1, num_decode_tokens=0)  # no real row: nothing written
                    with step_metadata(empty, self.kv_cache):
                        self._compiled(ids, torch.zeros_like(ids))
            except Exception:
                log.exception("compiling the decode step failed; this engine runs eager from now on")
                self.failed = True
                return
            self._ready.add(key)
            log.info("decode graph for %s compiled in %.1fs", "single rows" if key == 1 else "batches",
                     time.perf_counter() - t0)
