"""Doing the planned faults to a running cluster, one at a time, and waiting for it to heal.

Lifecycle of one fault (`FaultRunner`, on a thread of its own beside the load):
1. Wait for its planned time (and for the cluster to have recovered from the fault before).
2. Inject it (`inject`): SIGKILL (kill-worker, kill-router), SIGTERM (drain), SIGSTOP then SIGCONT
   after N seconds (freeze-worker: SIGCONT is sent whatever happens meanwhile), or the worker's
   fault-injection route (cut-kv). The time, the pid and URL hit, and what the fault reported go
   into an `Injection`.
3. Wait until the cluster is whole again (`wait_recovered`): a process that exited is ready again
   (the supervisor's `ready_again`), every worker is registered with the router and serving, and
   after a KV cut a prompt's KV has crossed a link again.
   Past the recovery timeout the fault is marked unrecovered and the next one goes on anyway.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

from pdserve.bench.chaos.cluster import ChaosCluster
from pdserve.bench.chaos.plan import PlannedFault

say = lambda msg: print(f"[bench chaos] {msg}", file=sys.stderr, flush=True)  # noqa: E731

RESTARTING = ("kill-worker", "kill-router", "drain")  # faults after which the process comes back anew


@dataclass(slots=True)
class Injection:
    fault: PlannedFault
    at: float  # monotonic time it went in
    pid: int  # the process it hit
    url: str  # that process's URL at the time
    resumed_at: float | None = None  # freeze-worker: when SIGCONT went
    reported: dict = field(default_factory=dict)  # what the fault-injection route answered (cut-kv)
    error: str = ""  # why the fault could not be done
    recovered_at: float | None = None  # when the cluster was seen whole again
    landed_before: int = 0  # cut-kv: prompts' KV landed on the workers before the cut

    def as_dict(self, t0: float) -> dict:
        rel = lambda t: None if t is None else round(t - t0, 3)  # noqa: E731
        return {**self.fault.as_dict(), "injected_s": rel(self.at), "pid": self.pid, "url": self.url,
                "resumed_s": rel(self.resumed_at), "reported": self.reported, "error": self.error,
                "recovered_s": rel(self.recovered_at)}


def inject(cluster: ChaosCluster, fault: PlannedFault) -> Injection:
    pid, url = cluster.pid(fault.target), cluster.url_of(fault.target)
    done = Injection(fault, time.monotonic(), pid, url)
    if fault.kind in ("kill-worker", "kill-router"):
        os.kill(pid, signal.SIGKILL)
    elif fault.kind == "drain":
        os.kill(pid, signal.SIGTERM)
    elif fault.kind == "freeze-worker":
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(fault.seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
            done.resumed_at = time.monotonic()
    elif fault.kind == "cut-kv":
        done.landed_before = landed(cluster)
        try:
            r = httpx.post(url + "/v1/faults/cut-kv-links", headers=cluster.worker_headers, timeout=10.0)
            if r.status_code == 200:
                done.reported = r.json()
            else:
                done.error = f"the worker refused the cut: HTTP {r.status_code}"
        except httpx.HTTPError as e:
            done.error = f"the worker did not answer the cut: {type(e).__name__}"
    else:
        raise ValueError(f"unknown fault {fault.kind!r}")
    return done


def wait_recovered(cluster: ChaosCluster, injection: Injection, timeout_s: float) -> bool:
    """Until the process hit is back (if it was to exit) and every worker is registered and serving."""
    deadline = time.monotonic() + timeout_s
    fault = injection.fault
    if fault.kind in RESTARTING:
        while cluster.event_after("ready_again", fault.target, injection.at) is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
    if not cluster.wait_all_registered(max(0.0, deadline - time.monotonic())):
        return False
    if fault.kind == "cut-kv":  # healed once a prompt's KV crossed a link again
        while landed(cluster) <= injection.landed_before:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
    injection.recovered_at = time.monotonic()
    return True


def landed(cluster: ChaosCluster) -> int:
    """Prompts' KV that landed on the workers as they are now (their own /stats)."""
    cluster.refresh()
    stats = [cluster.worker_stats(cluster.urls[name]) for name in cluster.worker_names]
    return sum(s.get("kv_landed", 0) for s in stats if s is not None)


class FaultRunner:
    """Runs `plan` against the cluster from `t0` (the load's start) on a thread: `injections` as
    they happen; `finished` once the last fault has recovered or timed out, or `stop` was set."""

    def __init__(self, cluster: ChaosCluster, plan: list[PlannedFault], t0: float, recovery_timeout_s: float) -> None:
        self.cluster, self.plan, self.t0, self.recovery_timeout_s = cluster, plan, t0, recovery_timeout_s
        self.injections: list[Injection] = []
        self.skipped: list[PlannedFault] = []
        self.stop = threading.Event()
        self.finished = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="chaos-faults")

    def start(self) -> FaultRunner:
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            for i, fault in enumerate(self.plan):
                if self.stop.wait(max(0.0, self.t0 + fault.at_s - time.monotonic())):
                    self.skipped.extend(self.plan[i:])
                    return
                injection = inject(self.cluster, fault)
                self.injections.append(injection)
                say(f"{time.monotonic() - self.t0:6.1f}s  {fault.kind} {fault.target} (pid {injection.pid})"
                    + (f": {injection.error}" if injection.error else ""))
                if wait_recovered(self.cluster, injection, self.recovery_timeout_s):
                    say(f"{time.monotonic() - self.t0:6.1f}s  recovered from {fault.kind} "
                        f"in {injection.recovered_at - injection.at:.1f}s")
                else:
                    say(f"{time.monotonic() - self.t0:6.1f}s  not recovered from {fault.kind} {fault.target} "
                        f"within {self.recovery_timeout_s:g}s")
        finally:
            self.finished.set()
