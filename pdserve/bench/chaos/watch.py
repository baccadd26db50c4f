"""What the run sees of the cluster while it runs: a sample every half second of the router's view of
its workers (GET /admin/workers) and of each worker's own counters (GET /stats), timestamped on
the same monotonic clock as the supervisor's events and the requests. recovery.py reads the marks
of each recovery from them; a progress line goes to stderr every few seconds."""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable

from pdserve.bench.chaos.cluster import ChaosCluster

SAMPLE_EVERY_S = 0.5
STAT_FIELDS = ("num_steps", "kv_landed", "kv_recomputed", "kv_notified", "kv_blocks_used")


class Watcher:
    def __init__(self, cluster: ChaosCluster, progress: Callable[[], str], progress_every_s: float = 5.0) -> None:
        self.cluster, self.progress, self.progress_every_s = cluster, progress, progress_every_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="chaos-watch")

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def sample(self) -> dict:
        """{"at", "router_up", "registered": {url: role, state, heartbeat age}, "stats": {url: counters}}."""
        at = time.monotonic()
        workers = self.cluster.registered()
        self.cluster.refresh()
        stats = {}
        for name in self.cluster.worker_names:
            url = self.cluster.urls[name]
            if (s := self.cluster.worker_stats(url)) is not None:
                stats[url] = {k: s.get(k, 0) for k in STAT_FIELDS}
        return {"at": at, "router_up": workers is not None,
                "registered": {w["url"]: {"role": w["role"], "state": w["state"],
                                          "heartbeat_age_s": w["heartbeat_age_s"]} for w in workers or []},
                "stats": stats}

    def _run(self) -> None:
        last_shown = time.monotonic()
        while not self._stop.wait(max(0.0, SAMPLE_EVERY_S - (time.monotonic() - self._last_at()))):
            self.samples.append(self.sample())
            if time.monotonic() - last_shown >= self.progress_every_s:
                last_shown = time.monotonic()
                print(f"[bench chaos] {self.progress()}", file=sys.stderr, flush=True)

    def _last_at(self) -> float:
        return self.samples[-1]["at"] if self.samples else 0.0
