"""uvicorn's HTTP/1.1 protocol (h11) with what it lacks against slow or greedy clients.

- A deadline on request heads. uvicorn's keep-alive timer is cancelled by the first byte that
  arrives, and nothing times the rest: a client sending its headers a byte at a time held a
  connection (and a concurrency slot) forever. Here, whenever a connection serves no request
  (just opened, or its last response sent), it must present a complete request head within
  `head_timeout_s`, or it is closed. The same clock bounds the draining of a body left unread
  by an early answer (401, 413), which uvicorn discards as it arrives.
- The concurrency limit answered in the API's error shape: uvicorn's own answers text/plain,
  so its check is switched off here and made again as the request starts: past `limit_concurrency`
  open connections, or requests in flight, a request is answered 503 and its connection closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from pdserve.http_errors import APIError, error_response


class GuardedH11Protocol(H11Protocol):
    """uvicorn builds one per connection; pass `functools.partial(GuardedH11Protocol,
    head_timeout_s=...)` as `uvicorn.Config(http=...)`, with `limit_concurrency` set there."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, head_timeout_s: float) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._max_concurrency = self.limit_concurrency
        self.limit_concurrency = None  # uvicorn's check, answered as text/plain; `_admit` makes it instead
        self._app = self.app
        self.app = self._admit

    # -- the head deadline ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._disarm()

    def _watch_head(self) -> None:
        """Armed from the moment the connection serves no request until a request head arrives
        whole; partial heads do not restart it, which is the point."""
        serving = self.cycle is not None and not self.cycle.response_complete
        if serving or self.transport.is_closing():
            self._disarm()
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        self.transport.close()  # `connection_lost` follows, and closes the h11 side

    # -- the concurrency limit -----------------------------------------------------------------

    async def _admit(self, scope: Scope, receive: Receive, send: Send) -> None:
        # runs as the request's own task, counted in `tasks` as its connection is in `connections`:
        # at most `limit` of each are served
        limit = self._max_concurrency
        if limit is not None and (len(self.connections) > limit or len(self.tasks) > limit):
            self.logger.warning("past the concurrency limit (%d): answered 503", limit)
            busy = APIError(503, "the server is at its concurrency limit; retry shortly", "service_unavailable",
                            headers={"Retry-After": "1", "Connection": "close"})
            await error_response(busy)(scope, receive, send)
            return
        await self._app(scope, receive, send)
