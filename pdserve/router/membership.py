"""The routes workers use to join and leave the router (worker token only): register, renew the
lease by heartbeat (its stats are the load the policies route by), deregister once drained.

- POST /internal/register    Registration -> Registered (409 for a worker of another model)
- POST /internal/heartbeat   Heartbeat (404: unknown, register again)
- POST /internal/deregister  Deregistration
- GET  /internal/peer        PeerState: what another router of the cluster asks each round (`peer_state.py`)
- POST /internal/move        PeerMove: the leading router's relief moves a stream this router follows
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pdserve import wire
from pdserve.errors import OtherModel, RegistrationError
from pdserve.http_errors import APIError, message_body, require_bearer
from pdserve.router.peer_state import PeerMove, own_state
from pdserve.router.router import Router

log = logging.getLogger("pdserve.router")


def add_membership_routes(app: FastAPI, router: Router) -> None:
    cfg = router.config

    def check_worker_token(request: Request) -> None:
        require_bearer(request, cfg.worker_token, "worker token")

    @app.post("/internal/register")
    async def register(request: Request):
        check_worker_token(request)
        body = await message_body(request, wire.Registration)
        try:
            stable = router.rollout.stable
            entry = router.registry.register(body.url.rstrip("/"), body.role, body.model_hash, cfg.worker_token,
                                             body.block_size, body.node, body.version,
                                             new_model_ok=stable is not None and body.version != stable)
        except OtherModel as e:
            raise APIError(409, str(e)) from None
        except RegistrationError as e:
            raise APIError(400, str(e)) from None
        router.rollout.first_version(entry.version)
        if entry.rejoined:
            router.metrics.worker_rejoins.labels(entry.role).inc()
            log.warning("worker %s registered again (restarted or dropped before): %s at %s", entry.worker_id,
                        entry.role, entry.url)
        else:
            log.info("worker %s registered: %s at %s%s", entry.worker_id, entry.role, entry.url,
                     f" (version {entry.version})" if entry.version else "")
        answer = wire.Registered(worker_id=entry.worker_id, lease_s=router.registry.lease_s,
                                 heartbeat_s=router.heartbeat_s)
        return Response(wire.encode(answer), media_type="application/json")

    @app.post("/internal/heartbeat")
    async def heartbeat(request: Request):
        check_worker_token(request)
        body = await message_body(request, wire.Heartbeat)
        try:
            router.registry.heartbeat(body.worker_id, body.stats, cfg.worker_token)
        except KeyError:
            raise APIError(404, "unknown worker: register again", "not_found_error") from None
        return {"ok": True}

    @app.get("/internal/peer")
    async def peer(request: Request):
        check_worker_token(request)
        return Response(wire.encode(own_state(router)), media_type="application/json")

    @app.post("/internal/move")
    async def move(request: Request):
        check_worker_token(request)
        body = await message_body(request, PeerMove)
        live = router.live.get(body.stream_id)
        hot, target = router.registry.at_url(body.worker_url), router.registry.at_url(body.target_url)
        if (live is None or not live.movable or hot is None or target is None or live.worker_id != hot.worker_id
                or not target.decodes or target.version != hot.version or target is hot):
            return {"moved": False}  # it ended, moved, or the workers changed since the leader looked
        return {"moved": await router.move_stream(live, hot, target)}

    @app.post("/internal/deregister")
    async def deregister(request: Request):
        check_worker_token(request)
        body = await message_body(request, wire.Deregistration)
        entry = router.registry.remove(body.worker_id)
        if entry is not None:
            log.info("worker %s left (drained): %s at %s", entry.worker_id, entry.role, entry.url)
        return {"ok": True}
