"""The cluster a chaos run breaks: `pdserve serve` as a child, and what the run knows of its processes.

Lifecycle:
1. Start `pdserve serve` with the tcp KV backend, the workers' fault-injection route on, a short
   restart backoff, and fresh secrets (the workers' token, the admin key) given through the
   environment, never on a command line; its stderr goes to a log file.
2. While it runs, each process is known by its name in `pdserve serve` ("router",
   "decode worker 1"): its pid and URL from the ready line, then from the supervisor's events
   (`restarted` gives the new pid, `ready_again` the new URL), read as they arrive.
3. `stop()`: the launcher stops every child; KV pool files a killed worker left in /dev/shm are
   removed.
"""

from __future__ import annotations

import secrets
import sys
import time
from pathlib import Path

import httpx

from pdserve.bench.local_cluster import LocalCluster
from pdserve.bench.soak.cluster import _last_line
from pdserve.credentials import ADMIN_KEY_ENV, TOKEN_ENV
from pdserve.bench.soak.audit import alive
from pdserve.kv_transfer.shm import SHM_DIR


class ChaosCluster(LocalCluster):
    def __init__(self, model: str, serve_args: list[str], log_path: Path, restart_backoff_s: float = 2.0,
                 timeout_s: float = 900.0) -> None:
        self.token = secrets.token_hex(32)
        self.admin_key = secrets.token_urlsafe(24)
        self.shm_before = _kv_pool_files()

        def progress(_: float) -> None:
            print(f"[bench chaos] still starting: {_last_line(log_path)}", file=sys.stderr, flush=True)

        extra = ["--transfer", "tcp", "--fault-injection", "--max-restart-backoff", f"{restart_backoff_s:g}",
                 *serve_args]
        super().__init__(model, extra, timeout_s, log_path, {TOKEN_ENV: self.token, ADMIN_KEY_ENV: self.admin_key},
                         progress)
        self.launcher_pid = self.proc.pid
        self.urls: dict[str, str] = {p["name"]: p["url"] for p in self.ready["processes"]}
        self.worker_names = [name for name in self.urls if not name.startswith("router")]
        self._events_seen = 0
        self.http = httpx.Client(timeout=5.0)

    # -- what each process is now ----------------------------------------------------------------

    def refresh(self) -> None:
        """Take in the supervisor's events that arrived since the last call."""
        for event in self.events[self._events_seen:]:
            name = event.get("name")
            if event["event"] == "restarted":
                self.pids[name] = event["pid"]
            elif event["event"] == "ready_again" and event.get("url"):
                self.urls[name] = event["url"]
        self._events_seen = len(self.events)

    def pid(self, name: str) -> int:
        self.refresh()
        return self.pids[name]

    def url_of(self, name: str) -> str:
        self.refresh()
        return self.urls[name]

    def event_after(self, kind: str, name: str, after: float) -> dict | None:
        """The first event of `kind` for `name` that arrived after the monotonic time `after`."""
        return next((e for e in self.events if e["event"] == kind and e.get("name") == name and e["at"] > after), None)

    # -- asking it -------------------------------------------------------------------------------

    @property
    def worker_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    def registered(self) -> list[dict] | None:
        """The router's view of its workers (GET /admin/workers); None while it does not answer."""
        try:
            r = self.http.get(self.url + "/admin/workers", headers=self.admin_headers)
        except httpx.HTTPError:
            return None
        return r.json()["workers"] if r.status_code == 200 else None

    def worker_stats(self, url: str) -> dict | None:
        """A worker's own /stats; None while it does not answer."""
        try:
            r = self.http.get(url + "/stats", headers=self.worker_headers, timeout=2.0)
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    def all_registered(self) -> bool:
        """Every worker, as it is now (its current URL), registered and serving."""
        workers = self.registered()
        if workers is None:
            return False
        self.refresh()
        serving = {w["url"] for w in workers if w["state"] == "serving"}
        return all(self.urls[name] in serving for name in self.worker_names)

    def wait_all_registered(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.all_registered():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def stop(self) -> None:
        self.http.close()
        super().stop()
        for path in _kv_pool_files() - self.shm_before:  # shared KV pools (--transfer shm) of killed workers
            if not alive(int(path.name.split("-")[2])):
                path.unlink(missing_ok=True)


def _kv_pool_files() -> set[Path]:
    """Shared KV pool files (`pdserve-kv-<pid>-<random>`)."""
    return set(Path(SHM_DIR).glob("pdserve-kv-*-*")) if Path(SHM_DIR).is_dir() else set()
