"""The gate in front of every HTTP app (router and workers), before a handler parses a byte.

In order, for each request:
1. Bearer secret: the first rule whose path covers the request decides; a wrong or missing
   secret is answered 401 from the head alone, so an unauthenticated client cannot make the
   server read, buffer or parse a body.
2. Framing: Content-Length together with Transfer-Encoding is refused (400): the two can
   disagree, and a proxy in front may frame the request differently from us (smuggling).
   A Content-Length past the limit is refused (413) before a body byte is read.
3. Body: read here, counting the bytes that really arrive (a chunked body declares no size),
   413 the moment the count passes the limit, 408 when the body is slower than its deadlines.
4. The app gets the whole body replayed as one `http.request` message; later `receive()` calls
   reach the server's own, so handlers still see `http.disconnect` when the client goes away.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.http_errors import APIError, error_response, require_bearer

# Refusals after which the connection cannot be trusted to continue: its framing is ambiguous,
# or its client is too slow to be worth waiting for. The others leave the server to drain the
# unread body (bounded by the listener's head deadline), so the client reads its answer
# instead of a reset.
_CLOSE = {"Connection": "close"}


@dataclass(frozen=True, slots=True)
class BodyLimits:
    max_bytes: int = 8 << 20
    timeout_s: float = 30.0  # the whole body, from the end of the head
    chunk_timeout_s: float = 10.0  # silence between two pieces of it

    def __post_init__(self) -> None:
        if self.max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {self.max_bytes}")
        if self.timeout_s <= 0 or self.chunk_timeout_s <= 0:
            raise ValueError(f"body timeouts must be > 0, got {self.timeout_s} and {self.chunk_timeout_s}")


@dataclass(frozen=True, slots=True)
class BearerRule:
    path: str  # this path and everything under it
    secret: str  # "" leaves the paths open
    what: str = "bearer token"  # named in the 401's message

    def covers(self, path: str) -> bool:
        return path == self.path or path.startswith(self.path.rstrip("/") + "/")


class _ClientGone(Exception):
    pass


class HTTPGuard:
    """Pure ASGI middleware (`app.add_middleware(HTTPGuard, limits=..., rules=...)`): it never
    wraps `send`, so streamed responses pass through untouched."""

    def __init__(self, app: ASGIApp, limits: BodyLimits, rules: Sequence[BearerRule]) -> None:
        self.app, self.limits, self.rules = app, limits, tuple(rules)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._authorize(scope)
            self._check_framing(scope)
            body = await self._read_body(receive)
        except APIError as e:
            await error_response(e)(scope, receive, send)
            return
        except _ClientGone:  # nobody to answer
            return
        await self.app(scope, _replay(body, receive), send)

    def _authorize(self, scope: Scope) -> None:
        rule = next((r for r in self.rules if r.covers(scope["path"])), None)
        if rule is not None:
            require_bearer(Request(scope), rule.secret, rule.what)

    def _check_framing(self, scope: Scope) -> None:
        lengths = [v for k, v in scope["headers"] if k == b"content-length"]  # ASGI names are lowercase
        if lengths and any(k == b"transfer-encoding" for k, _ in scope["headers"]):
            raise APIError(400, "send either Content-Length or Transfer-Encoding, not both", headers=_CLOSE)
        for value in lengths:
            if not value.strip().isdigit():
                raise APIError(400, "Content-Length must be a number of bytes", headers=_CLOSE)
            if int(value) > self.limits.max_bytes:
                raise self._too_large()

    async def _read_body(self, receive: Receive) -> bytes:
        limits = self.limits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                async with asyncio.timeout(min(limits.chunk_timeout_s, deadline - loop.time())):
                    message = await receive()
            except TimeoutError:
                raise APIError(408, f"the request body did not arrive in time (at most {limits.timeout_s:g} s, "
                                    f"{limits.chunk_timeout_s:g} s between pieces)", headers=_CLOSE) from None
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limits.max_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body exceeds {self.limits.max_bytes} bytes")


def _replay(body: bytes, receive: Receive) -> Receive:
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
