"""Clients that go away, or stop reading.

- `unless_disconnected`: ending work whose client went away, for responses that are not streamed.
  A streamed response learns of a vanished client when a write fails, and its generator is closed.
A plain JSON response computes everything first and writes once, so without this a request whose
client left would run to its end (minutes of a worker's time). Here the work runs beside a
watcher of the connection's `http.disconnect` event and is cancelled when it comes; the work's
own cleanup (closing worker streams) then aborts the request wherever it runs.
- `StallGuardedStreamingResponse`: a streamed response that gives up on a client that stops
  reading. A write waits for the client while the transport's buffers are full; one that waits
  longer than `stall_s` ends the stream: its generator is closed (releasing what the request holds:
  an admission slot, a worker's batch slot and KV) and the connection is closed. Without it, a
  client that reads a byte a minute holds all of that for as long as it likes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import anyio
from typing import Awaitable, Callable, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Send

log = logging.getLogger("pdserve.http")

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the response was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; cancels it and raises ClientGone if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(BaseException):
            await watcher
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    # The body was read before the handler ran: what `receive` yields now is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Stalled(Exception):
    pass


class ClosingStreamingResponse(StreamingResponse):
    """A streamed response that closes its generator however the response ends. Starlette stops
    iterating when the client disconnects (by cancelling the task that writes) but leaves the
    generator suspended at its `yield`; its `finally` (which aborts the request, releases its
    slot) would then run only when the garbage collector finalizes it, if ever. Here it runs at
    once, shielded from the cancellation that ended the response. A generator that never started
    (the client left before the first write) has no `finally` to run: `on_close` is called in every
    case, after the generator is closed, for what the request held before its stream began."""

    def __init__(self, content, on_close: Callable[[], None] | None = None, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()
            if self.on_close is not None:
                self.on_close()


class StallGuardedStreamingResponse(ClosingStreamingResponse):
    def __init__(self, content, stall_s: float, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.stall_s = stall_s
        self.stalled = False

    async def stream_response(self, send: Send) -> None:
        async def guarded(message: Message) -> None:
            try:
                async with asyncio.timeout(self.stall_s):
                    await send(message)
            except TimeoutError:
                raise _Stalled() from None

        try:
            await super().stream_response(guarded)
        except _Stalled:
            self.stalled = True
            log.warning("a client read nothing for %gs while output waited; its stream is closed", self.stall_s)
            # returning without the last message closes the connection; the generator is closed above
