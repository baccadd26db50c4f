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
- Batches are padded to a few sizes (1, 2, 4, 8, ...: `batch_buckets`), each its own static graph,
  as CUDA graphs are captured per size: the C++ GEMM templates need static shapes. Padded rows read
  token 0 at position 0 and write no KV (the attention operator computes the real rows only).
  Context lengths and block tables never reach the graph (the attention operator reads them, and
  the KV cache, from `step_metadata`), so they cause no recompiles.
- Weights are frozen into the graph (inductor's `freezing`): the model must hold them as plain
  tensors (`build_model(pack_weights=False)`), not in oneDNN's opaque layout.
- A bucket compiles on a thread of its own the first time a step needs it; until it is ready its
  steps run eager, so no request waits for a compile (`warm_up(sizes)` compiles and waits). Frozen
  graphs bypass inductor's graph cache: every process start compiles again (the C++ builds and
  autotuning choices are cached on disk, under pdserve's cache directory unless
  TORCHINDUCTOR_CACHE_DIR says otherwise). On a 2-vCPU Xeon a bucket of the default model takes
  ~85 s (~145 s the first time on a machine).
- A compile that fails is logged once, and the engine goes on eager.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path

import torch

from pdserve.layers.attention import AttentionMetadata, step_metadata
from pdserve.models.llama import LlamaForCausalLM

log = logging.getLogger("pdserve.engine")


def inductor_cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "pdserve" / "inductor"


def batch_buckets(max_rows: int) -> list[int]:
    """The padded batch sizes, powers of two up to `max_rows` (itself the last one)."""
    sizes, n = [], 1
    while n < max_rows:
        sizes.append(n)
        n *= 2
    return sizes + [max_rows]


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
    """Compiled decode graphs, one per batch bucket. A bucket not compiled yet is compiled on a
    thread of its own while its steps run eager (`__call__` returns None), so a server never stalls
    on a compile; `warm_up` compiles sizes and waits for them."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, max_rows: int) -> None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.buckets = batch_buckets(max_rows)
        self.failed = False
        self.num_steps = 0  # steps run compiled
        self._options = _inductor_options(self.device)
        # one static graph per bucket, counted apart from other engines' graphs of the same code
        self._compiled = torch.compile(_DecodeGraph(model), dynamic=False, fullgraph=True,
                                       recompile_limit=len(self.buckets) + 1, isolate_recompiles=True)
        self._ready: set[int] = set()
        self._wanted: queue.Queue[int] = queue.Queue()
        self._queued: set[int] = set()
        self._lock = threading.Lock()
        self._compiler: threading.Thread | None = None

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                 ) -> torch.Tensor | None:
        """[rows, vocab] float32 logits, or None when this step runs eager: its bucket is still
        compiling, the batch is past the largest bucket, or the model cannot be compiled."""
        rows = input_ids.shape[0]
        size = self.bucket(rows)
        if self.failed or size is None:
            return None
        if size not in self._ready:
            self._request(size)
            return None
        if size > rows:
            pad = size - rows
            input_ids = torch.cat([input_ids, input_ids.new_zeros(pad)])
            positions = torch.cat([positions, positions.new_zeros(pad)])
        with step_metadata(meta, self.kv_cache):
            logits = self._compiled(input_ids, positions)
        self.num_steps += 1
        return logits[:rows]

    def warm_up(self, sizes: list[int], timeout: float | None = None) -> bool:
        """Compile the graphs of these batch sizes (if not yet) and wait; False if the model cannot
        be compiled or `timeout` passed first."""
        wanted = {b for b in map(self.bucket, sizes) if b is not None}
        for size in sorted(wanted):
            self._request(size)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.failed and not wanted <= self._ready:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return not self.failed

    def _request(self, size: int) -> None:
        with self._lock:
            if size in self._queued:
                return
            self._queued.add(size)
            self._wanted.put(size)
            if self._compiler is None:
                self._compiler = threading.Thread(target=self._compile_loop, name="decode-compiler", daemon=True)
                self._compiler.start()

    def _compile_loop(self) -> None:
        while not self.failed:
            size = self._wanted.get()
            t0 = time.perf_counter()
            try:
                # inputs made as the engine makes its own (inference tensors): the same guards
                with torch.inference_mode(), torch._inductor.config.patch(self._options):
                    ids = torch.zeros(size, dtype=torch.long, device=self.device)
                    empty = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long, device=self.device),
                                              block_size=1, num_decode_tokens=0)  # no real row: nothing written
                    with step_metadata(empty, self.kv_cache):
                        self._compiled(ids, torch.zeros_like(ids))
            except Exception:
                log.exception("compiling the decode step failed; this engine runs eager from now on")
                self.failed = True
                return
            self._ready.add(size)
            log.info("decode graph for batches of up to %d compiled in %.1fs", size, time.perf_counter() - t0)
