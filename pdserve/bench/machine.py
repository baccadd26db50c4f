"""This machine's limits, measured on the spot (matmul throughput, memory bandwidth), and the facts
a benchmark records beside them (CPU, load, this process's memory).

Benchmarks divide by these for MFU and MBU. Measured rather than read from a datasheet, because
what counts is what this process gets now: its thread count, a shared host, a busy neighbour.
Both are best-of-N, so they are the ceiling of a quiet moment, and a takes-a-few-seconds estimate.
"""

from __future__ import annotations

import os
import platform
import resource
import time
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.config import resolve_dtype
from pdserve.layers.timing import best_seconds


@dataclass(slots=True, frozen=True)
class MachineLimits:
    dtype: str  # the matmul's dtype
    threads: int  # torch's intra-op threads when measured
    matmul_gflops: float  # best square matmul of side `matmul_size`, 2 * n**3 FLOP each
    read_gbs: float  # best sum over a `buffer_mib` float32 buffer: bytes read per second
    copy_gbs: float  # best copy between two such buffers, counting bytes read + bytes written
    matmul_size: int
    buffer_mib: int


def measure(dtype: torch.dtype | str = torch.float32, matmul_size: int = 2048, buffer_mib: int = 512,
            reps: int = 5) -> MachineLimits:
    dtype = resolve_dtype(dtype, torch.device("cpu"))
    read_gbs, copy_gbs = measure_bandwidth(buffer_mib, 2 * reps)  # ~50 ms a try: more tries, less noise
    return MachineLimits(
        dtype=str(dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        matmul_gflops=measure_matmul(dtype, matmul_size, reps),
        read_gbs=read_gbs,
        copy_gbs=copy_gbs,
        matmul_size=matmul_size,
        buffer_mib=buffer_mib,
    )


def measure_matmul(dtype: torch.dtype, size: int = 2048, reps: int = 5) -> float:
    """GFLOP/s of the best of `reps` [size, size] @ [size, size] products (after one warm-up)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    best = best_seconds(lambda: torch.mm(a, b, out=out), max(1, reps))
    return 2 * size**3 / best / 1e9


def measure_bandwidth(buffer_mib: int = 512, reps: int = 5) -> tuple[float, float]:
    """(read GB/s, copy GB/s). The buffer must dwarf the last-level cache, or this measures the cache."""
    numel = buffer_mib * (1 << 20) // 4
    src = torch.ones(numel)  # ones, not randn: filling 512 MiB with randn alone takes seconds
    dst = torch.empty(numel)
    dst.fill_(0)  # touch every page now, so the timed copy pays no page faults
    read = best_seconds(lambda: src.sum(), max(1, reps))
    copy = best_seconds(lambda: dst.copy_(src), max(1, reps))
    nbytes = src.nbytes
    return nbytes / read / 1e9, 2 * nbytes / copy / 1e9


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu": _cpu_name(),
        "load_average_start": os.getloadavg(),  # a busy neighbour shows here, and in every number
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()
