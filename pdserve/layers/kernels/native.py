"""pdserve's own CPU kernels (`qmatmul.c`): built with the system's C compiler on first use, cached
on disk, and loaded with ctypes.

The library holds a variant per instruction set (portable C, AVX2, AVX-512 VNNI, AVX-VNNI) and
reports which this CPU runs; the fastest is used unless `PDSERVE_CPU_ISA` names a lower one (the
tests run every variant the CPU has this way). Where no compiler is found or the build fails,
`load()` returns None once, with the reason logged, and callers use torch's own kernels instead.

The build is keyed by the sources, the compiler's version and this module's flags, so an upgrade
rebuilds; it takes about a second, and several processes starting at once each build into a file
of their own and rename it into place.
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

log = logging.getLogger("pdserve.kernels")

_SOURCES = ("qmatmul.c", "qmatmul_simd.h")
_CFLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno")
ISA_NAMES = ("portable", "avx2", "avx512_vnni", "avx_vnni")  # the C enum's order
ISA_ENV = "PDSERVE_CPU_ISA"


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "pdserve" / "kernels"


@dataclass(frozen=True, slots=True)
class NativeKernels:
    lib: ctypes.CDLL
    isa: int  # the variant calls run (an index into ISA_NAMES)
    supported: tuple[str, ...]  # every variant this CPU runs

    @property
    def isa_name(self) -> str:
        return ISA_NAMES[self.isa]

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


    def dequantize(self, bits: int, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                   out: torch.Tensor) -> torch.Tensor:
        """The weight into `out` ([out, in] float32 or bfloat16, contiguous)."""
        rc = self.lib.pd_dequantize(torch.get_num_threads(), bits, qs.data_ptr(), scales.data_ptr(),
                                    None if mins is None else mins.data_ptr(), out.shape[0], out.shape[1],
                                    out.data_ptr(), out.dtype == torch.bfloat16)
        if rc:
            raise RuntimeError(f"pd_dequantize refused a {bits}-bit weight into {tuple(out.shape)} {out.dtype}")
        return out


@functools.cache
def load() -> NativeKernels | None:
    """The kernels, built if need be; None where they cannot be built here."""
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
    lib.pd_dequantize.argtypes = [i32, i32, ptr, ptr, ptr, i64, i64, ptr, i32]
    lib.pd_dequantize.restype = i32
    supported = tuple(name for i, name in enumerate(ISA_NAMES) if lib.pd_isa_supported(i))
    kernels = NativeKernels(lib, ISA_NAMES.index(_preferred(supported)), supported)
    log.info("CPU kernels: %s (this CPU runs %s)", kernels.isa_name, ", ".join(supported))
    return kernels


def _preferred(supported: tuple[str, ...]) -> str:
    asked = os.environ.get(ISA_ENV)
    if asked:
        if asked not in ISA_NAMES:
            raise ValueError(f"{ISA_ENV}={asked!r}: choose one of {', '.join(ISA_NAMES)}")
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
    target = cache_dir() / f"qmatmul-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_CFLAGS, str(here / "qmatmul.c"), "-o", tmp],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
