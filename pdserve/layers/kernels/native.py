"""pdserve's own CPU kernels (`qmatmul.c`: quantized matmuls; `blocks.c`: weights in GGUF's block
formats, `block_kernels.py`; `ops.c`: the per-token operations of a decoder layer, decode
attention, and prefill attention on AMX tiles or in AVX512-BF16 dot products where the CPU has
them): built with the system's C compiler on first use, cached on disk, and loaded with ctypes.

The library holds a variant per instruction set (portable C, AVX2, AVX-512 VNNI, AVX-VNNI) and
reports which this CPU runs; the fastest is used unless `PDSERVE_CPU_ISA` names a lower one (the
tests run every variant the CPU has this way), or `none`: torch's kernels throughout. Where no compiler is found or the build fails,
`load()` returns None once, with the reason logged, and callers use torch's own kernels instead.

The build is keyed by the sources, the compiler's version and this module's flags, so an upgrade
rebuilds; it takes about 25 s on 2 cores (once a machine: a worker's first start), and several
processes starting at once each build into a file of their own and rename it into place.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch  # first: the library's OpenMP runtime must resolve to the one torch loaded

from pdserve.cache import cache_path
from pdserve.layers.kernels.block_kernels import BlockKernels, declare_block_kernels
from pdserve.layers.kernels.checks import check as _check, contiguous as _contiguous
from pdserve.layers.packed import activation_buffer

log = logging.getLogger("pdserve.kernels")

_SOURCES = ("common.h", "qmatmul.c", "qmatmul_simd.h", "qmatmul_panel.h", "dequant.c", "ops.c", "ops_body.h",
            "attention_bf16.h", "prefill_bf16.h", "prefill_amx.h", "qmatmul_amx.h", "decode_amx.h", "blocks.c",
            "blocks_format.h", "blocks_simd.h", "blocks_k.h", "blocks_dot.h", "blocks_amx.h", "vec8.h")
_COMPILED = ("qmatmul.c", "dequant.c", "ops.c", "blocks.c")
_CFLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno")
ISA_NAMES = ("portable", "avx2", "avx512_vnni", "avx_vnni")  # the C enum's order
ISA_ENV = "PDSERVE_CPU_ISA"
PREFILL_ATTENTION_KINDS = {"tiles": 2, "vectors": 1}  # the C bits, the faster first


def cache_dir() -> Path:
    return cache_path("kernels")


@dataclass(frozen=True, slots=True)
class NativeKernels:
    lib: ctypes.CDLL
    isa: int  # the variant calls run (an index into ISA_NAMES)
    supported: tuple[str, ...]  # every variant this CPU runs

    @property
    def isa_name(self) -> str:
        return ISA_NAMES[self.isa]

    @property
    def prefill_attention_kinds(self) -> tuple[str, ...]:
        """The kernels `prefill_attention` can run here, the faster first: "tiles" (AMX), "vectors"
        (AVX512-BF16 dot products); each with the AVX-512 variant only."""
        bits = _prefill_attention_kinds(self.lib, self.isa)
        return tuple(name for name, bit in PREFILL_ATTENTION_KINDS.items() if bits & bit)

    @property
    def prefill_attention_available(self) -> bool:
        return bool(self.prefill_attention_kinds)

    def with_isa(self, name: str) -> NativeKernels:
        """The same library running the variant `name` (one this CPU supports)."""
        if name not in self.supported:
            raise ValueError(f"this CPU cannot run the {name} kernels; it runs {', '.join(self.supported)}")
        return NativeKernels(self.lib, ISA_NAMES.index(name), self.supported)

    def qmatmul(self, x: torch.Tensor, bits: int, qs: torch.Tensor, scales: torch.Tensor,
                mins: torch.Tensor | None, out_features: int) -> torch.Tensor:
        """x [rows, in] float32 or bfloat16 (contiguous) -> [rows, out] in x's dtype."""
        rows, in_features = x.shape
        y = torch.empty(rows, out_features, dtype=x.dtype)
        rc = self.lib.pd_qmatmul(
            self.isa, torch.get_num_threads(), bits, x.data_ptr(), x.dtype == torch.bfloat16, rows,
            in_features, qs.data_ptr(), scales.data_ptr(), None if mins is None else mins.data_ptr(),
            out_features, y.data_ptr())
        if rc:
            raise RuntimeError(f"pd_qmatmul failed ({'bad arguments' if rc == -1 else 'out of memory'}): "
                               f"{bits}-bit, x {tuple(x.shape)}, {out_features} outputs")
        return y


    def panels_available(self, bits: int) -> bool:
        """Whether `panel_matmul` runs `bits`-bit weights here: 4-bit with a SIMD variant (AVX2,
        AVX-VNNI, AVX-512 VNNI), 8-bit with a VNNI one."""
        return _panels_available(self.lib, self.isa, bits)

    def panel_pack(self, bits: int, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                   out_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A 4- or 8-bit weight (`qmatmul`'s layout) repacked for `panel_matmul`: its bytes in panels of
        16 output rows, its scales (float16), and its minimums (4-bit, float16) or corrections
        (8-bit, int16). out_features must be a multiple of 16."""
        in_features = scales.shape[1] * 32
        _contiguous(qs, scales, *(() if mins is None else (mins,)))
        packed = torch.empty(out_features * in_features * bits // 8, dtype=torch.uint8)
        pd = torch.empty(out_features * in_features // 32, dtype=torch.float16)
        pm = torch.empty_like(pd, dtype=torch.float16 if bits == 4 else torch.int16)
        _check(self.lib.pd_panel_pack(bits, qs.data_ptr(), scales.data_ptr(), None if mins is None else mins.data_ptr(),
                                      out_features, in_features, packed.data_ptr(), pd.data_ptr(), pm.data_ptr()),
               "panel_pack")
        return packed, pd, pm

    def panel_matmul(self, x: torch.Tensor, bits: int, panels: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     out_features: int) -> torch.Tensor:
        """`qmatmul` of a weight packed by `panel_pack`, columns in the lanes: x [rows, in] float32 or
        bfloat16 (contiguous) -> [rows, out] in x's dtype."""
        rows, in_features = x.shape
        _contiguous(x)
        y = torch.empty(rows, out_features, dtype=x.dtype)
        packed, pd, pm = panels
        rc = self.lib.pd_panel_matmul(self.isa, torch.get_num_threads(), bits, x.data_ptr(),
                                      x.dtype == torch.bfloat16, rows, in_features, packed.data_ptr(), pd.data_ptr(),
                                      pm.data_ptr(), out_features, y.data_ptr())
        if rc:
            raise RuntimeError(f"pd_panel_matmul failed ({'bad arguments' if rc == -1 else 'out of memory'}): "
                               f"{bits}-bit, x {tuple(x.shape)}, {out_features} outputs")
        return y

    @property
    def qmatmul_amx_available(self) -> bool:
        """Whether `qmatmul_amx` runs here (AMX tiles and AVX-512 BF16, with the AVX-512 variant)."""
        return _qmatmul_amx_available(self.lib, self.isa)

    def qmatmul_amx(self, x: torch.Tensor, bits: int, qs: torch.Tensor, scales: torch.Tensor,
                    mins: torch.Tensor | None, out_features: int) -> torch.Tensor:
        """`qmatmul` on AMX tiles: x [rows, in] bfloat16 (contiguous) -> [rows, out]."""
        rows, in_features = x.shape
        if x.dtype != torch.bfloat16 or not x.is_contiguous():
            raise ValueError("qmatmul_amx takes contiguous bfloat16 rows")
        y = activation_buffer(rows, out_features, x.dtype)
        _check(self.lib.pd_qmatmul_amx(
            self.isa, torch.get_num_threads(), bits, x.data_ptr(), rows, in_features, qs.data_ptr(),
            scales.data_ptr(), None if mins is None else mins.data_ptr(), out_features, y.data_ptr()), "qmatmul_amx")
        return y

    def dequantize(self, bits: int, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                   out: torch.Tensor) -> torch.Tensor:
        """The weight into `out` ([out, in] float32 or bfloat16, contiguous)."""
        rc = self.lib.pd_dequantize(self.isa, torch.get_num_threads(), bits, qs.data_ptr(), scales.data_ptr(),
                                    None if mins is None else mins.data_ptr(), out.shape[0], out.shape[1],
                                    out.data_ptr(), out.dtype == torch.bfloat16)
        if rc:
            raise RuntimeError(f"pd_dequantize refused a {bits}-bit weight into {tuple(out.shape)} {out.dtype}")
        return out


    # -- weights in GGUF's block formats (blocks.c): their own composed object ----------------------

    @property
    def blocks(self) -> BlockKernels:
        """The block-format kernels of this library and variant (`block_kernels.py`)."""
        return _block_kernels(self.lib, self.isa)

    # -- the per-token operations (ops.c); tensors are float32 or bfloat16, contiguous rows --------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 delta: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, hidden] -> normalized and scaled, a new tensor. With `delta` (x's shape), x +=
        delta first, in place (a decoder's residual add, fused with the norm that follows it)."""
        _contiguous(x, weight)
        if delta is not None:
            _contiguous(delta)
            if delta.shape != x.shape or delta.dtype != x.dtype:
                raise ValueError(f"delta {tuple(delta.shape)} {delta.dtype} does not match x {tuple(x.shape)} {x.dtype}")
        y = activation_buffer(x.shape[0], x.shape[1], x.dtype)  # a product's input
        _check(self.lib.pd_rms_norm(self.isa, torch.get_num_threads(), x.data_ptr(),
                                    None if delta is None else delta.data_ptr(), weight.data_ptr(), eps,
                                    x.shape[0], x.shape[1], y.data_ptr(), x.dtype == torch.bfloat16), "rms_norm")
        return y

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * inter] (gate | up) -> silu(gate) * up, [rows, inter]."""
        return self._gated_mul(gate_up, self.lib.pd_silu_mul, "silu_mul")

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * inter] (gate | up) -> gelu(gate) * up (GELU's tanh form), [rows, inter]."""
        return self._gated_mul(gate_up, self.lib.pd_gelu_mul, "gelu_mul")

    def _gated_mul(self, gate_up: torch.Tensor, kernel, name: str) -> torch.Tensor:
        _contiguous(gate_up)
        rows, width = gate_up.shape
        out = activation_buffer(rows, width // 2, gate_up.dtype)  # a product's input
        _check(kernel(self.isa, torch.get_num_threads(), gate_up.data_ptr(), rows, width // 2, out.data_ptr(),
                      gate_up.dtype == torch.bfloat16), name)
        return out

    def rotary_store(self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor,
                     sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """Rotary embedding on qkv's q and k heads ([tokens, (heads + 2 kv_heads) * head_dim], in
        place, with cos/sin [tokens, head_dim]), then each token's k and v into its slot of
        kv_cache ([slots, 2, kv_heads, head_dim]; slots int64 [tokens])."""
        _contiguous(qkv, cos, sin, kv_cache, slots)
        _check(self.lib.pd_rotary_store(
            self.isa, torch.get_num_threads(), qkv.data_ptr(), qkv.shape[0], heads, kv_heads, head_dim,
            cos.data_ptr(), sin.data_ptr(), kv_cache.data_ptr(), slots.data_ptr(), qkv.dtype == torch.bfloat16),
            "rotary_store")

    def decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, block_size: int, tables: torch.Tensor,
                         lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
        """q [rows, heads, head_dim] (rows may be strided) attending to each row's context of
        `lens` tokens in the paged cache (tables int64 [rows, max_blocks]) -> [rows, heads * head_dim];
        with a sliding `window`, to the last `window` tokens of it only."""
        rows, heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            raise ValueError("decode_attention needs each row's heads side by side")
        _contiguous(kv_cache, tables, lens)
        out = activation_buffer(rows, heads * head_dim, q.dtype)  # a product's input
        _check(self.lib.pd_decode_attention(
            self.isa, torch.get_num_threads(), q.data_ptr(), q.stride(0), rows, heads, kv_cache.shape[2], head_dim,
            kv_cache.data_ptr(), block_size, tables.data_ptr(), tables.shape[1], lens.data_ptr(), window or 0, scale,
            out.data_ptr(), q.dtype == torch.bfloat16), "decode_attention")
        return out

    def prefill_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, block_size: int, table: torch.Tensor,
                          context_len: int, scale: float, out: torch.Tensor, kind: str | None = None) -> None:
        """A prefill chunk's causal attention into `out` ([chunk tokens, heads, head_dim] bfloat16;
        its rows may be strided): q [chunk tokens, heads, head_dim] (rows may be strided) are the
        last positions of a context of `context_len` tokens whose K/V are in kv_cache at the blocks
        of `table` (int64), the chunk's own included. Query i sees keys up to its own position.
        `kind`: one of `prefill_attention_kinds` (default: the first)."""
        kinds = self.prefill_attention_kinds
        kind = kind or (kinds[0] if kinds else "vectors")
        if kind not in PREFILL_ATTENTION_KINDS:
            raise ValueError(f"prefill attention runs as one of {', '.join(PREFILL_ATTENTION_KINDS)}, not {kind!r}")
        tokens, heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim or out.stride(2) != 1 or out.stride(1) != head_dim:
            raise ValueError("pdserve's prefill attention takes rows of whole heads side by side")
        _contiguous(kv_cache, table)
        _check(self.lib.pd_prefill_attention(
            self.isa, torch.get_num_threads(), PREFILL_ATTENTION_KINDS[kind], q.data_ptr(), q.stride(0), tokens, heads, kv_cache.shape[2], head_dim,
            kv_cache.data_ptr(), block_size, table.data_ptr(), context_len, scale, out.data_ptr(), out.stride(0)),
            "prefill_attention")


@functools.lru_cache(maxsize=None)
def _prefill_attention_kinds(lib: ctypes.CDLL, isa: int) -> int:
    return lib.pd_prefill_attention_kinds(isa)


@functools.lru_cache(maxsize=None)
def _block_kernels(lib: ctypes.CDLL, isa: int) -> BlockKernels:
    return BlockKernels(lib, isa, bool(lib.pd_qmatmul_amx_available(isa)))


@functools.lru_cache(maxsize=None)
def _panels_available(lib: ctypes.CDLL, isa: int, bits: int) -> bool:
    return bool(lib.pd_panels_available(isa, bits))


@functools.lru_cache(maxsize=None)
def _qmatmul_amx_available(lib: ctypes.CDLL, isa: int) -> bool:
    return bool(lib.pd_qmatmul_amx_available(isa))


@functools.cache
def load() -> NativeKernels | None:
    """The kernels, built if need be; None where they cannot be built here (or are turned off)."""
    if os.environ.get(ISA_ENV) == "none":
        log.info("pdserve's CPU kernels are off (%s=none); torch's kernels are used", ISA_ENV)
        return None
    try:
        path = _build()
    except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
        log.warning("pdserve's CPU kernels are unavailable (%s); torch's kernels are used instead", e)
        return None
    lib = ctypes.CDLL(str(path))
    lib.pd_isa_supported.argtypes = [ctypes.c_int]
    lib.pd_isa_supported.restype = ctypes.c_int
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.pd_qmatmul.argtypes = [i32, i32, i32, ptr, i32, i64, i64, ptr, ptr, ptr, i64, ptr]
    lib.pd_qmatmul.restype = i32
    lib.pd_dequantize.argtypes = [i32, i32, i32, ptr, ptr, ptr, i64, i64, ptr, i32]
    f32 = ctypes.c_float
    lib.pd_rms_norm.argtypes = [i32, i32, ptr, ptr, ptr, f32, i64, i64, ptr, i32]
    lib.pd_silu_mul.argtypes = lib.pd_gelu_mul.argtypes = [i32, i32, ptr, i64, i64, ptr, i32]
    lib.pd_rotary_store.argtypes = [i32, i32, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, i32]
    lib.pd_decode_attention.argtypes = [i32, i32, ptr, i64, i64, i64, i64, i64, ptr, i64, ptr, i64, ptr, i64, f32, ptr,
                                        i32]
    lib.pd_prefill_attention.argtypes = [i32, i32, i32, ptr, i64, i64, i64, i64, i64, ptr, i64, ptr, i64, f32, ptr,
                                         i64]
    lib.pd_prefill_attention_kinds.argtypes = [i32]
    lib.pd_panel_pack.argtypes = [i32, ptr, ptr, ptr, i64, i64, ptr, ptr, ptr]
    lib.pd_panel_matmul.argtypes = [i32, i32, i32, ptr, i32, i64, i64, ptr, ptr, ptr, i64, ptr]
    lib.pd_panels_available.argtypes = [i32, i32]
    lib.pd_qmatmul_amx.argtypes = [i32, i32, i32, ptr, i64, i64, ptr, ptr, ptr, i64, ptr]
    lib.pd_qmatmul_amx_available.argtypes = [i32]
    lib.pd_decode_stack.argtypes = [i32, i32, ptr, i64, i64, i64, i64, i64, i64, i64, f32, f32, i32, ptr, ptr, ptr,
                                    ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32, ptr, ptr, i64, ptr, i64, ptr, i64, ptr,
                                    i32]
    declare_block_kernels(lib)
    for name in ("pd_prefill_attention", "pd_prefill_attention_kinds", "pd_qmatmul_amx", "pd_panel_pack",
                 "pd_panel_matmul", "pd_panels_available",
                 "pd_qmatmul_amx_available", "pd_decode_stack", "pd_dequantize", "pd_rms_norm",
                 "pd_silu_mul", "pd_gelu_mul", "pd_rotary_store", "pd_decode_attention"):
        getattr(lib, name).restype = i32
    lib.pd_openmp_serial_here.argtypes, lib.pd_openmp_serial_here.restype = [], None
    lib.pd_bind_team.argtypes, lib.pd_bind_team.restype = [i32], i32
    supported = tuple(name for i, name in enumerate(ISA_NAMES) if lib.pd_isa_supported(i))
    kernels = NativeKernels(lib, ISA_NAMES.index(_preferred(supported)), supported)
    log.info("CPU kernels: %s (this CPU runs %s)", kernels.isa_name, ", ".join(supported))
    return kernels


def serial_torch_on_this_thread() -> None:
    """Torch's operators called from this thread run on it alone, never in an OpenMP team of its
    own. For threads beside the engine's (KV transfer): OpenMP keeps a pool for each thread that
    started a parallel region, and while a process holds more pooled threads than it has cores,
    waiting threads spin only briefly before sleeping, so the engine's every region waits for its
    threads to wake. Where the kernels do not build this does nothing."""
    kernels = load()
    if kernels is None:
        return
    torch.get_num_threads()  # torch sets a thread's team size on its first use there: before ours
    kernels.lib.pd_openmp_serial_here()


def bind_team_to_cores() -> bool:
    """Pins the calling thread's OpenMP team, one thread a CPU, where this process may run on
    exactly as many CPUs as the team has threads (a worker that owns its cores: the one worker of
    a small host, or one started with `--pin-cpus`); where it shares more CPUs with other workers
    the scheduler keeps placing them. Pinned, the team stops migrating when the router and the
    HTTP streams take turns on its cores: 16 medium prompts at once on a 2-vCPU Xeon ran 3-4%
    faster (means of 4 runs each, taking turns). True if pinned."""
    kernels = load()
    threads = torch.get_num_threads()
    if kernels is None or len(os.sched_getaffinity(0)) != threads:
        return False
    return kernels.lib.pd_bind_team(threads) == 0


def _preferred(supported: tuple[str, ...]) -> str:
    asked = os.environ.get(ISA_ENV)
    if asked:
        if asked not in ISA_NAMES:
            raise ValueError(f"{ISA_ENV}={asked!r}: choose one of {', '.join(ISA_NAMES)}, or none")
        if asked not in supported:
            raise ValueError(f"{ISA_ENV}={asked!r}, but this CPU runs only {', '.join(supported)}")
        return asked
    for name in ("avx512_vnni", "avx_vnni", "avx2"):
        if name in supported:
            return name
    return "portable"


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not compiler:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    here = Path(__file__).parent
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256(version.encode() + " ".join(_CFLAGS).encode())
    for name in _SOURCES:
        digest.update((here / name).read_bytes())
    target = cache_dir() / f"pdserve-kernels-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_CFLAGS, *(str(here / name) for name in _COMPILED), "-o", tmp],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
