"""The soak's audit: what must hold once the traffic has stopped.

1. Every request opened was judged (zero unaccounted), and none failed.
2. After a grace period the cluster is idle: every worker's KV blocks free, nothing running,
   waiting or waiting for KV, and the router holds no request (from the router's /metrics, which
   show each worker's last heartbeat).
3. No worker was dropped (`pdserve_workers_dropped_total` as at the start) and each role has as
   many workers as at the start.
4. The cluster's peak memory less its baseline is within the bound (proportional set size without
   shared memory: cluster.py says why).
5. Every process of the cluster is still alive.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
IDLE_GAUGES = ("kv_blocks_used", "running", "waiting", "waiting_for_kv")


@dataclass(frozen=True, slots=True)
class Metrics:
    """One scrape of the router's /metrics: (labels, value) per sample name."""

    samples: dict[str, list[tuple[dict[str, str], float]]]

    @classmethod
    def parse(cls, text: str) -> Metrics:
        samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for line in text.splitlines():
            if line.startswith("#") or not (m := _SAMPLE.match(line.strip())):
                continue
            samples.setdefault(m[1], []).append((dict(_LABEL.findall(m[2] or "")), float(m[3])))
        return cls(samples)

    def value(self, name: str, **labels: str) -> float:
        """The sum over the samples whose labels include `labels` (0 if none)."""
        return sum(v for lab, v in self.samples.get(name, ()) if all(lab.get(k) == x for k, x in labels.items()))

    def workers(self) -> dict[str, int]:
        return {lab["role"]: int(v) for lab, v in self.samples.get("pdserve_workers", ()) if v}

    def busy(self) -> dict[str, float]:
        """What is still held: per worker and gauge, and the router's queue; empty when idle."""
        out = {f"{lab.get('worker')} ({lab.get('role')}) {gauge}": v
               for gauge in IDLE_GAUGES for lab, v in self.samples.get(f"pdserve_worker_{gauge}", ()) if v}
        if queued := self.value("pdserve_queue_requests"):
            out["router queue"] = queued
        return out

    def summary(self) -> dict:
        return {"workers": self.workers(), "workers_dropped": self.value("pdserve_workers_dropped_total"),
                "requests": {lab["outcome"]: v for lab, v in self.samples.get("pdserve_requests_total", ())},
                "busy": self.busy()}


def scrape(url: str) -> Metrics:
    r = httpx.get(url.rstrip("/") + "/metrics", timeout=10)
    r.raise_for_status()
    return Metrics.parse(r.text)


def wait_idle(url: str, grace_s: float, settle_s: float = 2.0) -> tuple[Metrics, float, list[dict]]:
    """The first scrape showing the cluster idle that a scrape `settle_s` later confirms (a heartbeat
    comes every second), or the last one at the end of the grace period; the seconds waited; and
    what was still held at each scrape that changed it (does it drain, or is it stuck?)."""
    start = time.monotonic()
    idle_since = None
    trace: list[dict] = []
    while True:
        m = scrape(url)
        now = time.monotonic()
        busy = m.busy()
        if not trace or trace[-1]["busy"] != busy:
            trace.append({"t_s": round(now - start, 1), "busy": busy})
        if busy:
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= settle_s:
            return m, now - start, trace
        if now - start > grace_s:
            return m, now - start, trace
        time.sleep(0.5)


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    passed: bool
    detail: str


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def audit(table: dict[str, dict], failures: int, start: Metrics, end: Metrics, waited_s: float, grace_s: float,
          memory: dict, pids: dict[str, int]) -> list[Check]:
    """Every check, passed or not; `memory` holds baseline_mib, peak_mib and bound_mib."""
    unaccounted = {a: row["unaccounted"] for a, row in table.items() if row["unaccounted"]}
    opened = sum(row["opened"] for row in table.values())
    checks = [Check("every request accounted for", not unaccounted,
                    f"{opened} opened, {opened - sum(unaccounted.values())} judged"
                    + (f"; unaccounted: {unaccounted}" if unaccounted else "")),
              Check("no failures", failures == 0, f"{failures} requests failed")]
    busy = end.busy()
    checks.append(Check("idle after the grace period", not busy,
                        f"idle {waited_s:.1f} s after the traffic stopped" if not busy
                        else f"still held after {grace_s:g} s: {busy}"))
    dropped = end.value("pdserve_workers_dropped_total") - start.value("pdserve_workers_dropped_total")
    same = end.workers() == start.workers()
    checks.append(Check("no worker dropped", dropped == 0 and same,
                        f"{dropped:g} dropped; workers {end.workers()} (at the start {start.workers()})"))
    growth = memory["peak_mib"] - memory["baseline_mib"]
    checks.append(Check("memory growth within bound", growth <= memory["bound_mib"],
                        f"peak {memory['peak_mib']:.0f} MiB - baseline {memory['baseline_mib']:.0f} MiB = "
                        f"{growth:+.0f} MiB (bound {memory['bound_mib']:g} MiB; PSS without shared memory)"))
    dead = [name for name, pid in pids.items() if not alive(pid)]
    checks.append(Check("cluster processes alive", not dead,
                        f"all {len(pids)} alive" if not dead else f"gone: {', '.join(dead)}"))
    return checks


def as_dicts(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]
