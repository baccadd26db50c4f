"""A worker's membership in a router: register, then renew the lease with heartbeats of its stats.

Lifecycle:
1. Register (URL, role, model hash) with the cluster token; the router answers with an id and a
   lease length, or refuses (wrong token, another model), which is logged and retried.
2. Every third of the lease, send `/stats` as a heartbeat; a router that no longer knows the id
   (it restarted, or the lease lapsed) is registered with again, and so is one whose entry is of
   another role than the stats report (the role changed): a heartbeat only ever renews an entry
   of the role it reports.
3. Nothing ends the thread but `stop()`: a router that is down, refuses, or answers garbage, and
   a stats call that fails, are logged (the first of a streak at once, then every
   `REPORT_EVERY_S`) and retried; `status` says how the last attempt went (the worker's
   /health shows it).
4. `beat_now()` sends the next heartbeat at once (a draining worker says so without delay; a
   worker in a new role registers in it, and the router replaces the entry at its URL).
5. `leave()` ends the thread and deregisters: the router drops the worker now. `stop()` ends the
   thread only; the router drops the worker when its lease runs out.
With several routers (replicas), the worker is a member of each (`Memberships`), independently.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import httpx
import msgspec

from pdserve import wire
from pdserve.errors import RegistrationError
from pdserve.router_addresses import Refreshed, expand, resolve_name

log = logging.getLogger("pdserve.worker.registration")

REPORT_EVERY_S = 30.0


class RouterMembership:
    def __init__(self, router_url: str, own_url: str, role: str, model_hash: str,
                 stats: Callable[[], wire.WorkerStats], token: str = "", block_size: int = 16, node: str = "",
                 version: str = "") -> None:
        self.router_url = router_url.rstrip("/")
        self.registration = wire.Registration(url=own_url, role=role, model_hash=model_hash, block_size=block_size,
                                              node=node, version=version)
        self.stats = stats
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.worker_id: str | None = None
        self.status = "registering"
        self.interval = 1.0
        self._failing_since: float | None = None
        self._last_report = 0.0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-heartbeat", daemon=True)

    def start(self) -> RouterMembership:
        self._thread.start()
        return self

    def stop(self, wait: bool = True) -> None:
        """End the heartbeat thread (`wait`: and wait for it, at most 5 s)."""
        self._stop.set()
        self._wake.set()
        if wait:
            self._thread.join(5)

    def beat_now(self) -> None:
        self._wake.set()

    def leave(self) -> None:
        self.stop()
        if self.worker_id is None:
            return
        try:
            with httpx.Client(timeout=5.0, headers=self.headers) as http:
                http.post(self.router_url + "/internal/deregister",
                          content=wire.encode(wire.Deregistration(worker_id=self.worker_id)))
        except httpx.HTTPError as e:  # the router drops it when its lease runs out instead
            log.warning("router %s: could not deregister: %s", self.router_url, e)

    def _run(self) -> None:
        with httpx.Client(timeout=5.0, headers=self.headers) as http:
            while not self._stop.is_set():
                try:
                    self._beat(http)
                    self._recovered()
                except Exception as e:  # whatever failed, the next beat tries again
                    self.worker_id = None
                    self._failed(e)
                self._wake.wait(self.interval)
                self._wake.clear()

    def _failed(self, e: Exception) -> None:
        now = time.monotonic()
        self.status = f"unregistered: {type(e).__name__}: {e}"
        if self._failing_since is None:
            self._failing_since = now
        if now - self._last_report >= REPORT_EVERY_S or self._last_report < self._failing_since:
            log.warning("router %s: %s (retrying every %.1fs)", self.router_url, self.status, self.interval)
            self._last_report = now

    def _recovered(self) -> None:
        if self._failing_since is not None:
            log.info("router %s: registered again after %.0fs", self.router_url, time.monotonic() - self._failing_since)
            self._failing_since = None
        self.status = "registered"

    def _beat(self, http: httpx.Client) -> None:
        stats = self.stats()
        if stats.role != self.registration.role:
            # The role changed (on another thread) since this worker registered: these stats must
            # not renew the old role's entry, or the router would route that role's work here.
            self.registration = msgspec.structs.replace(self.registration, role=stats.role)
            self.worker_id = None
        if self.worker_id is None:
            r = http.post(self.router_url + "/internal/register", content=wire.encode(self.registration))
            if r.status_code != 200:
                raise RegistrationError(f"registration refused: {wire.decode(r.content, wire.ErrorReply).error.message}")
            answer = wire.decode(r.content, wire.Registered)
            every = answer.heartbeat_s or answer.lease_s / 3  # loads fresh enough to route by
            self.worker_id, self.interval = answer.worker_id, max(0.05, every)
            log.info("registered with %s as %s", self.router_url, self.worker_id)
        beat = wire.Heartbeat(worker_id=self.worker_id, stats=stats)
        r = http.post(self.router_url + "/internal/heartbeat", content=wire.encode(beat))
        if r.status_code == 404:  # the router forgot us (restarted, or the lease lapsed): register again now
            self.worker_id = None
            raise RegistrationError("the router no longer knows this worker")
        if r.status_code != 200:
            raise RegistrationError(f"heartbeat refused: HTTP {r.status_code}")


class Memberships:
    """A worker's memberships in each router of its cluster (router replicas: each router has the
    whole membership and every worker's load). Each is a `RouterMembership` of its own: a router
    that is down delays no other's heartbeats. Routers named by a dns+ address
    (`router_addresses.py`) are looked up again every few seconds: a new one is joined, one gone
    is let go."""

    def __init__(self, spec: str, member: Callable[[str], RouterMembership], resolve=resolve_name) -> None:
        self.member = member
        self.members = [member(url) for url in expand(spec, resolve)]
        self._lock = threading.Lock()
        self._refresh = Refreshed(spec, self.refresh, resolve)

    def start(self) -> Memberships:
        for m in self.members:
            m.start()
        self._refresh.start()
        return self

    def refresh(self, urls: list[str]) -> None:
        """Join the routers of `urls` not joined yet; let go of those no longer among them."""
        with self._lock:
            have = {m.router_url: m for m in self.members}
            gone = [m for url, m in have.items() if url not in urls]
            new = [self.member(url).start() for url in urls if url not in have]
            self.members = [m for m in self.members if m.router_url in urls] + new
        for m in gone:
            log.info("router %s is no longer listed: its membership ends", m.router_url)
            m.stop(wait=False)
        for m in new:
            log.info("router %s found: registering with it", m.router_url)

    def stop(self) -> None:
        self._refresh.stop()
        members = self.members
        for m in members:  # all told at once, then waited for
            m.stop(wait=False)
        for m in members:
            m.stop()

    def beat_now(self) -> None:
        for m in self.members:
            m.beat_now()

    def leave(self) -> None:
        self._refresh.stop()
        for m in self.members:
            m.leave()

    @property
    def status(self) -> str:
        members = self.members
        if len(members) == 1:
            return members[0].status
        if not members:
            return "no router address resolves yet"
        return "; ".join(f"{m.router_url}: {m.status}" for m in members)
