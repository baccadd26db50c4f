"""With several routers, admin calls are the leader's: one that reaches a follower is passed on to
the leading router and its answer returned as it is, so a rollout, a shadow, a drain or a role
change is decided once per cluster whichever router's address the operator used (followers take
the leader's versions state each round, `peer_state.py`).

- A router alone, or the leader, answers itself.
- A router that has not yet asked its peers who is alive (its first round) answers 503 with
  Retry-After: it cannot yet tell who leads.
- A leader that does not answer: 503 naming it; a router that stays silent `DEAD_AFTER_S` is no
  longer the leader, and the call goes to the next one.
A call passed on carries `FORWARDED`: the receiver answers it itself, so two routers that briefly
disagree on who leads never pass a call back and forth; the answer returned carries it too.
"""

from __future__ import annotations

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from pdserve.http_errors import APIError
from pdserve.router.router import Router

FORWARDED = "X-Pdserve-Forwarded"
FORWARD_TIMEOUT_S = 30.0
PASSED_HEADERS = ("authorization", "content-type")


class AnsweredByLeader(Exception):
    def __init__(self, response: Response) -> None:
        self.response = response


def at_the_leader(app: FastAPI, router: Router):
    """A dependency for the admin routes: nothing where this router answers; otherwise the
    leader's answer (raised, and returned by the handler this installs)."""

    @app.exception_handler(AnsweredByLeader)
    async def _answered(request, e: AnsweredByLeader):
        return e.response

    async def check(request: Request) -> None:
        peers = router.peers
        if not peers.peers or FORWARDED in request.headers:
            return
        if not peers.asked_all:
            raise APIError(503, "this router is still learning which router of the cluster leads: try again",
                           "service_unavailable", headers={"Retry-After": "1"})
        leader = peers.leader
        if leader == peers.own_url:
            return
        headers = {k: v for k, v in request.headers.items() if k.lower() in PASSED_HEADERS}
        url = leader + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        try:
            r = await router.http.request(request.method, url, content=await request.body(),
                                          headers={**headers, FORWARDED: "1"}, timeout=FORWARD_TIMEOUT_S)
        except httpx.HTTPError:
            raise APIError(503, f"the leading router {leader} did not answer: try again", "service_unavailable",
                           headers={"Retry-After": "1"}) from None
        raise AnsweredByLeader(Response(r.content, r.status_code, media_type=r.headers.get("content-type"),
                                        headers={FORWARDED: "1"}))  # says whose answer it is

    return check
