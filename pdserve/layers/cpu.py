"""What the CPU under this process can run, found out at run time.

The same code runs on x86-64 CPUs with AVX2 only, with AVX-512 (some with bfloat16 and VNNI
instructions) and with AMX. Nothing here is a table of CPU models: each answer is torch's or
oneDNN's own, or the result of trying the operation once. Both libraries honour their own
environment overrides (`ATEN_CPU_CAPABILITY=avx2`, `ONEDNN_MAX_CPU_ISA=AVX2`), which is how the
tests run the portable paths on a CPU that has the fast ones.
"""

from __future__ import annotations

import functools
import platform

import torch


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The kernel's flags for this CPU (`/proc/cpuinfo`); empty where that file is absent."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def aten_capability() -> str:
    """The vector instruction set torch's own CPU kernels were dispatched to: AVX512, AVX2, DEFAULT."""
    return torch.backends.cpu.get_cpu_capability()


@functools.cache
def onednn_packs_bfloat16() -> bool:
    """Whether oneDNN can hold bfloat16 weights in its blocked layout here: it needs AVX-512 (BW,
    VL, DQ) or AVX-NE-CONVERT, and raises on an AVX2-only CPU. Asked, then tried once."""
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), None)
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16, dtype=torch.bfloat16), packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def has_native_bfloat16() -> bool:
    """Instructions that compute on bfloat16 (AVX512-BF16 or AMX-BF16); without them bfloat16 is
    converted to float32 and back around every operation."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags()) and aten_capability() == "AVX512"


def describe_cpu() -> str:
    """One line naming the CPU and the instruction sets pdserve's kernels choose between."""
    sets = [s for s in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
            if s in cpu_flags()]
    return f"{cpu_model_name()} ({', '.join(sets) or 'no AVX2'}; torch kernels: {aten_capability()})"
