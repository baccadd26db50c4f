"""Requests streaming from decode workers, as the router follows them.

Each worker call is read by a task of its own into the stream's inbox, so that the router can end a
wait on a worker that stopped answering (the registry's reaper puts `WorkerLost` there) instead
of hanging on a socket, and can move a running request elsewhere (hot-spot relief) between lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx

from pdserve import wire
from pdserve.http_errors import APIError
from pdserve.router.policy import RunningStream

_END = object()
_ALIVE = object()  # a worker's keep-alive line
INBOX_LINES = 256  # output lines held per request before the worker is made to wait (slow clients)

log = logging.getLogger("pdserve.router")


class WorkerLost(Exception):
    """The worker serving a stream was dropped from the registry (its lease lapsed)."""


class NoRoom(APIError):
    """Every decode worker holds as many sequences from this router as it said it can take."""

    def __init__(self) -> None:
        super().__init__(503, "every worker is at its capacity; retry shortly", "overloaded",
                         headers={"Retry-After": "1"})


class WorkerSilent(WorkerLost):
    """One stream heard nothing from its worker for too long. The stream gives up on that worker;
    the worker itself stays registered while its heartbeats say it lives (the reaper drops it
    when they stop), so one stuck request never fails the worker's other streams."""


@dataclass(eq=False)
class LiveStream:
    """What the rest of the router may know of, and ask of, a request being streamed: its worker
    and its size (for relief and the reaper), a move (`ask_to_move`, by hot-spot relief) and the
    loss of its worker (`worker_lost`, by the reaper). Only its owner (`request_stream.RequestStream`)
    reads the answers; nothing else writes its fields."""

    request_id: str
    n: int
    context_tokens: int  # prompt + generated so far
    remaining_tokens: int
    worker_id: str = ""
    worker_request_id: str = ""  # the id of the current call on that worker
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    _move_target: Any = None  # a registry entry: relief asked this request to move there

    def tokens_arrived(self, n: int) -> None:
        self.context_tokens += n
        self.remaining_tokens -= n

    @property
    def movable(self) -> bool:
        """A single completion not already on its way to another worker."""
        return self.n == 1 and self._move_target is None

    @property
    def moving_to(self) -> Any:
        return self._move_target

    def ask_to_move(self, target: Any) -> None:
        """Hot-spot relief: continue on `target`, taking the KV from the current worker, once the
        current worker stops the request (the caller asks it to, by an abort)."""
        assert self.movable, f"stream {self.request_id} cannot move now"
        self._move_target = target

    def cancel_move(self) -> None:
        self._move_target = None

    def stopped_for_move(self, out: wire.CompletionDelta) -> bool:
        """Whether this line's abort is the move's doing (the request goes on), not an end."""
        return out.finish_reason == "abort" and self._move_target is not None

    def take_move(self) -> Any:
        """The worker to continue on, and the move done."""
        target, self._move_target = self._move_target, None
        return target

    def worker_lost(self, reason: str) -> None:
        """The reaper dropped this stream's worker: the stream ends its call now."""
        self.inbox.put_nowait(WorkerLost(reason))

    def running(self) -> RunningStream:
        return RunningStream(self.request_id, self.worker_id, self.context_tokens, self.remaining_tokens)


async def worker_lines(http: httpx.AsyncClient, url: str, body: wire.GenerateRequest, headers: dict,
                       live: LiveStream, silence_s: float = 60.0) -> AsyncIterator[wire.OutputLine]:
    """The output lines of one `/v1/generate` call. Raises what the call raised, `WorkerLost`
    when the reaper says so or the worker says nothing (workers send an empty line every few
    seconds while a request waits) for `silence_s`, and APIError for a worker's refusal, its
    error line, or a request the worker's engine failed. Leaving early closes the call and tells
    the worker to abort the request (`/v1/abort`): the closed connection alone reaches a busy
    worker late, or not at all."""
    inbox = live.inbox = asyncio.Queue()  # lines, and the reaper's WorkerLost, which never waits
    room = asyncio.Semaphore(INBOX_LINES)  # lines not yet read: a slow client makes the worker wait

    async def pump() -> None:
        try:
            async with http.stream("POST", url + "/v1/generate", content=wire.encode(body), headers=headers) as r:
                if r.status_code != 200:
                    raise worker_error(r.status_code, await r.aread())
                taken.set()
                async for line in r.aiter_lines():
                    await room.acquire()
                    inbox.put_nowait(_parse(line))
            inbox.put_nowait(_END)
        except BaseException as e:  # handed over to the reader
            inbox.put_nowait(e)

    taken = asyncio.Event()  # the worker took the request (answered 200): it has something to abort
    task = asyncio.create_task(pump())
    ended = False
    try:
        while True:
            item = await get_within(inbox, silence_s)
            if item is None:
                raise WorkerSilent(f"no word from the worker for {silence_s:.0f}s")
            if item is _ALIVE or isinstance(item, (wire.OutputLine, wire.ErrorReply)):
                room.release()
            if item is _END:
                ended = True
                return
            if item is _ALIVE:
                continue
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, wire.ErrorReply):
                raise APIError(500, "the worker failed while running this request", "server_error")
            if any(out.finish_reason == "error" for out in item.outputs):
                raise APIError(500, "the engine failed on this request", "server_error")
            yield item
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        if taken.is_set() and not ended:
            abort_on_worker(http, url, body.request_id, headers)


def _parse(line: str) -> wire.OutputLine | wire.ErrorReply | object:
    if not line.strip():
        return _ALIVE
    try:
        return wire.decode_line(line)
    except wire.BadMessage as e:
        raise WorkerLost(f"the worker sent a line that is not an output: {e}") from None


async def get_within(queue: asyncio.Queue, timeout: float):
    """The queue's next item, or None if none comes within `timeout` seconds."""
    if not queue.empty():  # the common case while tokens flow: no timer
        return queue.get_nowait()
    try:
        async with asyncio.timeout(timeout):
            return await queue.get()
    except TimeoutError:
        return None


_aborts: set[asyncio.Task] = set()  # in flight; held so that none is collected before it ends


def abort_on_worker(http: httpx.AsyncClient, url: str, request_id: str, headers: dict,
                    index: int | None = None) -> None:
    """Tell a worker to drop a request (or only its completion `index`), in the background
    (idempotent there; a failure only logged: a worker that cannot be reached has dropped it
    anyway, or the reaper will drop the worker)."""
    async def send() -> None:
        try:
            abort = wire.AbortRequest(request_id=request_id, index=index)
            await http.post(url + "/v1/abort", content=wire.encode(abort), headers=headers, timeout=10)
        except httpx.HTTPError as e:
            log.info("abort of %s on %s failed: %s", request_id, url, e)

    task = asyncio.get_running_loop().create_task(send())
    _aborts.add(task)
    task.add_done_callback(_aborts.discard)


def worker_error(status: int, raw: bytes) -> APIError:
    """A worker's refusal as the client should see it: its own words for a request it found bad
    (4xx), and nothing internal (addresses, exception text) for a failure of its own."""
    if status >= 500:
        return APIError(503 if status == 503 else 502, "the worker could not take the request; retry",
                        "server_error", headers={"Retry-After": "1"} if status == 503 else None)
    try:
        err = wire.decode(raw, wire.ErrorReply).error
    except wire.BadMessage:
        return APIError(502, f"the worker answered HTTP {status}", "server_error")
    return APIError(status, err.message, err.type)
