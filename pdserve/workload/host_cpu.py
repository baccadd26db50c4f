"""Whose CPU a measurement ran on (Linux /proc): the benchmark's own processes, everything else
on the machine, and the hypervisor's steal.

On a shared machine a load point can be slow because something else ran beside it. A benchmark
that records how many cores the rest of the machine took while it ran can say so, instead of
reporting a neighbour's noise as the server's latency:

    meter = HostCpu(pids)        # the client and the cluster's processes
    ... run the load point ...
    meter.cores()                # {"ours": 1.62, "others": 0.03, "steal": 0.0, "cores": 2}
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
NOISY_OTHERS_CORES = 0.1  # more than this, taken by other processes, and a point is flagged


def process_cpu_s(pid: int) -> float:
    """User + system seconds of a process (all its threads); 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (fields 14 and 15 of stat)


def machine_cpu_s() -> tuple[float, float]:
    """(busy, steal) seconds summed over the machine's CPUs since boot."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (ticks + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) * _TICK_S, steal * _TICK_S


class HostCpu:
    """Cores used between construction and `cores()`: by `pids`, by the rest of the machine, and
    stolen by the hypervisor. A process of `pids` that has ended by `cores()` can no longer be read:
    its CPU counts as the rest of the machine's."""

    def __init__(self, pids: list[int], clock: Callable[[], float] = time.monotonic) -> None:
        self.pids = list(pids)
        self._clock = clock  # the wall clock the rates are per second of
        self._t0 = clock()
        self._ours0 = {pid: process_cpu_s(pid) for pid in self.pids}
        self._busy0, self._steal0 = machine_cpu_s()

    def cores(self) -> dict[str, float]:
        elapsed = max(self._clock() - self._t0, 1e-9)
        ours = sum(max(process_cpu_s(pid) - c0, 0.0) for pid, c0 in self._ours0.items())
        busy, steal = machine_cpu_s()
        others = max(busy - self._busy0 - ours, 0.0)
        return {"ours": round(ours / elapsed, 3), "others": round(others / elapsed, 3),
                "steal": round((steal - self._steal0) / elapsed, 3), "cores": len(os.sched_getaffinity(0))}


def noisy(host_cpu: dict | None) -> bool:
    """Whether other processes (or the hypervisor) took enough CPU to cloud a load point."""
    return bool(host_cpu) and host_cpu["others"] + host_cpu["steal"] > NOISY_OTHERS_CORES
