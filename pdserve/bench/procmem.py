"""Memory of running processes, for benchmarks that report it (Linux /proc)."""

from __future__ import annotations

from pathlib import Path


def memory_mib(pid: int) -> float:
    """The process's proportional set size in MiB: its private pages plus its share of pages it
    shares with others (a KV pool in shared memory, mapped by two workers, counts once in their
    sum). Resident set size where the kernel has no smaps_rollup. NaN if unreadable."""
    for name, key in (("smaps_rollup", "Pss:"), ("status", "VmRSS:")):
        try:
            text = Path(f"/proc/{pid}/{name}").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    return float("nan")
