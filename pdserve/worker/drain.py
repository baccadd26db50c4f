"""Draining a worker: SIGTERM (or SIGINT, or POST /v1/drain, which the router's admin API sends)
makes it leave the cluster without failing a request.

1. It takes no new request (503, which the router answers by routing elsewhere) and says so in an
   immediate heartbeat: the router stops choosing it, and hot-spot relief moves its running
   requests to other decode workers with their KV (the leases they need are still served here).
2. Whatever it still holds runs to its end, for at most `timeout_s`.
3. It deregisters from the router, and the HTTP server stops: the process exits 0.
A second signal during the drain stops the server at once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import uvicorn

    from pdserve.worker.worker import Worker

log = logging.getLogger("pdserve.worker.drain")


class Drain:
    def __init__(self, worker: Worker, server: uvicorn.Server, timeout_s: float) -> None:
        self.worker, self.server, self.timeout_s = worker, server, timeout_s
        self.started = threading.Event()
        self._lock = threading.Lock()
        self._force = type(server).handle_exit

    def handle_signal(self, sig: int, frame) -> None:
        """Installed as the server's signal handler: the first signal drains, a second one stops now."""
        if self.started.is_set():
            self._force(self.server, sig, frame)
        else:
            self.begin()

    def begin(self) -> None:
        """Start draining, once; later calls change nothing."""
        with self._lock:
            if self.started.is_set():
                return
            self.started.set()
        threading.Thread(target=self._run, name="drain", daemon=True).start()

    def _run(self) -> None:
        t0 = time.monotonic()
        log.info("draining: taking no new requests, finishing the %s held (at most %.0fs)",
                 self._held(), self.timeout_s)
        self.worker.drain()
        membership = self.worker.membership
        if membership is not None:
            membership.beat_now()
        while not self.worker.idle() and time.monotonic() - t0 < self.timeout_s:
            time.sleep(0.1)
        if self.worker.idle():
            log.info("drained in %.1fs", time.monotonic() - t0)
        else:
            log.warning("drain timed out after %.0fs with %s still held; stopping anyway", self.timeout_s, self._held())
        if membership is not None:
            membership.leave()
        self.server.should_exit = True

    def _held(self) -> str:
        s = self.worker.stats()
        return f"{s.running} running, {s.waiting} queued, {s.waiting_for_kv} waiting for KV"
