"""A worker's membership in a router: register, then renew the lease with heartbeats of its stats.

Lifecycle:
1. Register (URL, role, model hash) with the cluster token; the router answers with an id and a
   lease length, or refuses (wrong token, another model), which is logged and retried.
2. Every third of the lease, send `/stats` as a heartbeat; a router that no longer knows the id
   (it restarted, or the lease lapsed) is registered with again.
3. `stop()` ends the thread; the router drops the worker when its lease runs out.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import httpx

log = logging.getLogger("pdserve.worker.registration")


class RouterMembership:
    def __init__(self, router_url: str, own_url: str, role: str, model_hash: str, stats: Callable[[], dict],
                 token: str = "") -> None:
        self.router_url = router_url.rstrip("/")
        self.body = {"url": own_url, "role": role, "model_hash": model_hash}
        self.stats = stats
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.worker_id: str | None = None
        self.interval = 1.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-heartbeat", daemon=True)

    def start(self) -> RouterMembership:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        with httpx.Client(timeout=5.0, headers=self.headers) as http:
            while not self._stop.is_set():
                try:
                    self._beat(http)
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    log.warning("router %s: %s", self.router_url, e)
                    self.worker_id = None
                self._stop.wait(self.interval)

    def _beat(self, http: httpx.Client) -> None:
        if self.worker_id is None:
            r = http.post(self.router_url + "/internal/register", json=self.body)
            if r.status_code != 200:
                raise ValueError(f"registration refused: {r.json()['error']['message']}")
            answer = r.json()
            every = answer.get("heartbeat_s") or answer["lease_s"] / 3  # loads fresh enough to route by
            self.worker_id, self.interval = answer["worker_id"], max(0.05, float(every))
            log.info("registered with %s as %s", self.router_url, self.worker_id)
        r = http.post(self.router_url + "/internal/heartbeat", json={"worker_id": self.worker_id, "stats": self.stats()})
        if r.status_code == 404:
            self.worker_id = None
        elif r.status_code != 200:
            raise ValueError(f"heartbeat refused: HTTP {r.status_code}")
