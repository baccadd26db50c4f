"""The admin API's routes for versions: a canary rollout (`rollout.py` has its rules) and shadow
traffic (`shadow.py`).

- GET  /admin/rollout            its state: stable and canary versions, the canary's share, the
                                 step, each version's outcomes in the step, the events so far
- POST /admin/rollout            {"canary": "v2", "steps": [0.05, 0.25, 0.5, 1.0], "step_s": 60, ...}:
                                 start moving traffic to the canary (409 while one runs, or
                                 where no decode worker of that version is registered)
- POST /admin/rollout/pause      hold the canary's share; /resume goes on (the step starts again)
- POST /admin/rollout/promote    the canary becomes the stable version now
- POST /admin/rollout/abort      the canary gets no new request from now on
- GET  /admin/shadow             the shadow's report (404 when none runs): the copies this router made,
                                 one of `routers` (replicas each copy their share of their own requests)
- POST /admin/shadow             {"version": "v2", "share": 0.1, "max_concurrency": 4, "timeout_s": 120}:
                                 copy that share of requests to that version's workers (409
                                 for the stable version, or one with no decode worker)
- POST /admin/shadow/stop        stop copying; the answer is the final report
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Annotated

from fastapi import APIRouter, Request
from msgspec import Meta

from pdserve import wire
from pdserve.http_errors import APIError, message_body
from pdserve.router.rollout import RolloutError, RolloutPolicy
from pdserve.router.router import Router
from pdserve.router.shadow import Shadow

log = logging.getLogger("pdserve.router")
_DEFAULT = RolloutPolicy()
Share = Annotated[float, Meta(gt=0, le=1)]
Seconds = Annotated[float, Meta(gt=0, le=86_400)]


Label = Annotated[str, Meta(min_length=1, max_length=64, pattern=wire.VERSION_LABEL)]


class ShadowStart(wire.Message):
    version: Label
    share: Share = 0.1
    max_concurrency: Annotated[int, Meta(ge=1, le=1024)] = 4
    timeout_s: Seconds = 120.0


class RolloutStart(wire.Message):
    canary: Label
    steps: Annotated[tuple[Share, ...], Meta(min_length=1, max_length=16)] = _DEFAULT.steps
    step_s: Seconds = _DEFAULT.step_s
    min_requests: Annotated[int, Meta(ge=1, le=1_000_000)] = _DEFAULT.min_requests
    max_error_increase: Annotated[float, Meta(ge=0, le=1)] = _DEFAULT.max_error_increase
    max_attainment_drop: Annotated[float, Meta(ge=0, le=1)] = _DEFAULT.max_attainment_drop
    min_errors: Annotated[int, Meta(ge=1, le=1_000_000)] = _DEFAULT.min_errors
    lost_s: Seconds = _DEFAULT.lost_s


def add_version_routes(app: APIRouter, router: Router) -> None:
    add_rollout_routes(app, router)
    add_shadow_routes(app, router)


def add_shadow_routes(app: APIRouter, router: Router) -> None:
    @app.get("/admin/shadow")
    async def report():
        if router.shadow is None:
            raise APIError(404, "no shadow traffic runs", "not_found_error")
        return shadow_report(router, router.shadow)

    @app.post("/admin/shadow")
    async def start(request: Request):
        body = await message_body(request, ShadowStart)
        if body.version == router.rollout.stable:
            raise APIError(409, f"{body.version!r} is the stable version: it serves the requests already", "conflict",
                           "version")
        if not router.registry.workers("decode", body.version):
            raise APIError(409, f"no decode or colocated worker of version {body.version!r} is registered",
                           "conflict", "version")
        if router.shadow is not None:
            await router.shadow.close()
        router.shadow = Shadow(router, body.version, body.share, body.max_concurrency, body.timeout_s)
        log.warning("shadow traffic: %.0f%% of requests copied to %s (at most %d at once)", 100 * body.share,
                    body.version, body.max_concurrency)
        return shadow_report(router, router.shadow)

    @app.post("/admin/shadow/stop")
    async def stop():
        shadow, router.shadow = router.shadow, None
        if shadow is None:
            raise APIError(404, "no shadow traffic runs", "not_found_error")
        await shadow.close()
        log.warning("shadow traffic to %s stopped", shadow.version)
        return shadow_report(router, shadow)


def shadow_report(router: Router, shadow: Shadow) -> dict:
    """The shadow's report, saying whose copies it counts: with router replicas each router copies
    its share of its own requests, and the report is the answering router's (the leader's)."""
    return {**shadow.report(), "routers": 1 + len(router.peers.alive()), "copies_of": "this router"}


def add_rollout_routes(app: APIRouter, router: Router) -> None:
    rollout = router.rollout

    @app.get("/admin/rollout")
    async def status():
        return rollout.status()

    @app.post("/admin/rollout")
    async def start(request: Request):
        body = await message_body(request, RolloutStart)
        fields = {f.name: getattr(body, f.name) for f in dataclasses.fields(RolloutPolicy)}
        try:
            policy = RolloutPolicy(**fields)
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(":")[0]) from None
        if not router.registry.workers("decode", body.canary):
            raise APIError(409, f"no decode or colocated worker of version {body.canary!r} is registered", "conflict",
                           "canary")
        with _conflicts():
            rollout.start(body.canary, policy)
        log.warning("rollout of %s started: %s", body.canary, ", ".join(f"{s:.0%}" for s in policy.steps))
        return rollout.status()

    def command(name: str, act, counted: str | None = None) -> None:
        async def route():
            with _conflicts():
                act()
            if counted is not None:
                router.metrics.rollouts.labels(counted).inc()
            log.warning("rollout of %s: %s by hand", rollout.canary, name)
            return rollout.status()
        app.post(f"/admin/rollout/{name}")(route)

    command("pause", rollout.pause)
    command("resume", rollout.resume)
    command("promote", rollout.promote, "promoted")
    command("abort", rollout.abort, "aborted")


@contextlib.contextmanager
def _conflicts():
    """A command that does not fit the rollout's state: 409, with why."""
    try:
        yield
    except RolloutError as e:
        raise APIError(409, str(e), "conflict") from None
