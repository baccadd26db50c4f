"""The cluster a soak runs against, and what is watched while it runs.

- `SoakCluster`: `pdserve serve` as a child process, its API key given through the environment
  and its stderr kept in a log file (the place to look when the soak finds something).
- Memory: each process's proportional set size, split into shared memory and the rest. Workers
  that share a KV pool keep it in /dev/shm, and its pages count only once first written: the pool
  fills up to its fixed size (`--kv-cache-memory`) as blocks are first used, which is not growth to
  worry about. The bound applies to the rest: private and file-backed pages.
- `Monitor`: a sample a second (memory, the router's queue, KV blocks and requests on workers) and
  a progress line on stderr.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx

from pdserve.bench.local_cluster import LocalCluster
from pdserve.bench.soak.audit import scrape
from pdserve.bench.soak.outcomes import Ledger
from pdserve.credentials import API_KEY_ENV


def pss_mib(pid: int) -> tuple[float, float] | None:
    """(proportional set size, its shared-memory part) in MiB; None for a process that is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    fields = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("Pss", "Pss_Shmem"):
            fields[key] = int(rest.split()[0]) / 1024
    return fields.get("Pss", 0.0), fields.get("Pss_Shmem", 0.0)


class SoakCluster(LocalCluster):
    """`pdserve serve` as a child, its stderr in `log_path`, the API key in its environment."""

    def __init__(self, model: str, extra: list[str], api_key: str, log_path: Path, timeout_s: float = 900.0) -> None:
        def progress(_: float) -> None:
            print(f"[bench soak] still starting: {_last_line(log_path)}", file=sys.stderr, flush=True)

        super().__init__(model, extra, timeout_s, log_path, {API_KEY_ENV: api_key}, progress)
        self.pids = {"launcher": self.proc.pid, **self.pids}

    def memory(self) -> dict:
        """The cluster's memory now: PSS in all, its shared-memory part, the rest, and PSS per process."""
        parts = {name: m for name, pid in self.pids.items() if (m := pss_mib(pid)) is not None}
        total = sum(p for p, _ in parts.values())
        shmem = sum(s for _, s in parts.values())
        return {"total_mib": round(total, 1), "shmem_mib": round(shmem, 1), "rest_mib": round(total - shmem, 1),
                "by_process": {name: round(p, 1) for name, (p, _) in parts.items()}}


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:160] if lines else ""


class Monitor:
    """Samples the cluster every second, and shows progress on stderr, until `stop()`."""

    def __init__(self, cluster: SoakCluster, ledger: Ledger, duration_s: float, baseline: dict) -> None:
        self.cluster, self.ledger, self.duration_s, self.baseline = cluster, ledger, duration_s, baseline
        self.samples: list[dict] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="soak-monitor")
        self.tty = sys.stderr.isatty()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def peak(self, key: str) -> float:
        return max((s[key] for s in self.samples), default=self.baseline[key])

    def _run(self) -> None:
        last_shown = float("-inf")
        while not self._done.wait(1.0):
            sample = {"t_s": round(time.monotonic() - self.ledger.t0, 1), **self.cluster.memory()}
            try:
                m = scrape(self.cluster.url)
                sample.update(router_queue=m.value("pdserve_queue_requests"),
                              kv_blocks_used=m.value("pdserve_worker_kv_blocks_used"),
                              running=m.value("pdserve_worker_running"), waiting=m.value("pdserve_worker_waiting"))
            except httpx.HTTPError:
                pass
            self.samples.append(sample)
            if self.tty or sample["t_s"] - last_shown >= 5.0:
                last_shown = sample["t_s"]
                self._show(sample)
        if self.tty:
            print(file=sys.stderr)

    def _show(self, sample: dict) -> None:
        opened, judged, failures = self.ledger.totals()
        labels = ", ".join(f"{k} {v}" for k, v in sorted(self.ledger.by_label().items(), key=lambda kv: -kv[1]))
        line = (f"[bench soak] {min(sample['t_s'], self.duration_s):.0f}/{self.duration_s:g} s | {judged} judged, "
                f"{opened - judged} in flight, {failures} failures | {labels} | memory {sample['rest_mib']:.0f} MiB "
                f"({sample['rest_mib'] - self.baseline['rest_mib']:+.0f}) + shared {sample['shmem_mib']:.0f}")
        print(line, end="\r" if self.tty else "\n", file=sys.stderr, flush=True)
