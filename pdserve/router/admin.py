"""The router's admin API, for operators (and the P:D controller): which workers it has, and
draining one. Served only when an admin key is set (`--admin-key-file` or PDSERVE_ADMIN_KEY),
and only to Bearer holders of that key; without one the routes do not exist.

- GET  /admin/workers               every registered worker: id, role, state, url, host, node, KV usage,
                                    running and queued requests, seconds since its last heartbeat
- POST /admin/workers/{id}/drain    the worker takes no new request, finishes (or hands over) what
                                    it holds, leaves and exits 0 (`pdserve serve` starts it again)
- POST /admin/workers/{id}/role     {"role": "prefill" | "decode" | "both"}: the worker drains in
                                    place, then registers again in that role, without restarting
- /admin/rollout..., /admin/shadow... a canary rollout of another version, and shadow traffic to
                                    one (`admin_versions.py`)
With several routers every admin call is answered by the leading one (`admin_at_leader.py`).
"""

from __future__ import annotations

import logging
import time
from urllib.parse import urlsplit

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request

from pdserve import wire
from pdserve.http_errors import APIError, message_body
from pdserve.router.admin_at_leader import at_the_leader
from pdserve.router.admin_versions import add_version_routes
from pdserve.router.registry import WorkerEntry
from pdserve.router.router import Router

log = logging.getLogger("pdserve.router")


def worker_view(entry: WorkerEntry, now: float) -> dict:
    s = entry.stats
    return {
        "id": entry.worker_id, "role": entry.role, "state": "draining" if s.draining else "serving",
        "url": entry.url, "host": urlsplit(entry.url).hostname,
        "node": entry.node, "kv_usage": round(entry.load.kv_usage, 4),
        "running": s.running, "queued": s.waiting + s.waiting_for_kv,
        "heartbeat_age_s": round(now - entry.last_heartbeat, 3), "version": entry.version,
    }


def add_admin_routes(app: FastAPI, router: Router) -> None:
    api = APIRouter(dependencies=[Depends(at_the_leader(app, router))])  # with several routers: the leader's
    add_version_routes(api, router)

    def entry_of(worker_id: str) -> WorkerEntry:
        entry = router.registry.get(worker_id)
        if entry is None:
            raise APIError(404, f"no worker {worker_id!r} is registered", "not_found_error", "worker_id")
        return entry

    @api.get("/admin/workers")
    async def workers():
        now = time.monotonic()
        return {"workers": [worker_view(e, now) for e in router.registry.workers()]}

    async def forward(worker_id: str, path: str, body: wire.Message | None = None) -> None:
        entry = entry_of(worker_id)
        try:
            r = await router.http.post(entry.url + path, content=wire.encode(body) if body else None,
                                       headers=router.worker_headers, timeout=10.0)
        except httpx.HTTPError:
            raise APIError(502, f"worker {worker_id} could not be reached", "server_error") from None
        if r.status_code == 409:
            raise APIError(409, f"worker {worker_id} is draining or already changing its role", "conflict")
        if r.status_code != 200:
            raise APIError(502, f"worker {worker_id} refused (HTTP {r.status_code})", "server_error")

    @api.post("/admin/workers/{worker_id}/drain")
    async def drain(worker_id: str):
        await forward(worker_id, "/v1/drain")
        return {"id": worker_id, "state": "draining"}

    @api.post("/admin/workers/{worker_id}/role")
    async def role(worker_id: str, request: Request):
        body = await message_body(request, wire.RoleChange)
        await forward(worker_id, "/v1/role", body)
        log.info("worker %s: role change to %s asked", worker_id, body.role)
        return {"id": worker_id, "role": body.role, "state": "changing"}

    app.include_router(api)
