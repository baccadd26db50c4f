"""Requests streaming from decode workers, as the router follows them.

Each worker call is read by a task of its own into the stream's inbox, so that the router can end a
wait on a worker that stopped answering (the registry's reaper puts `WorkerLost` there) instead
of hanging on a socket, and can move a running request elsewhere (hot-spot relief) between lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx

from pdserve.http_errors import APIError
from pdserve.router.policy import RunningStream

_END = object()


class WorkerLost(Exception):
    """The worker serving a stream was dropped from the registry (its lease lapsed)."""


@dataclass(eq=False)
class LiveStream:
    request_id: str
    n: int
    context_tokens: int  # prompt + generated so far
    remaining_tokens: int
    worker_id: str = ""
    worker_request_id: str = ""  # the id of the current call on that worker
    move_to: Any = None  # a registry entry: hot-spot relief asked this request to move there
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)

    def tokens_arrived(self, n: int) -> None:
        self.context_tokens += n
        self.remaining_tokens -= n

    def running(self) -> RunningStream:
        return RunningStream(self.request_id, self.worker_id, self.context_tokens, self.remaining_tokens)


async def worker_lines(http: httpx.AsyncClient, url: str, body: dict, headers: dict,
                       live: LiveStream) -> AsyncIterator[dict]:
    """The output lines of one `/v1/generate` call. Raises what the call raised, `WorkerLost`
    when the reaper says so, and APIError for a worker's refusal or error line. Leaving early
    closes the call, which aborts the request on the worker."""
    inbox = live.inbox = asyncio.Queue()

    async def pump() -> None:
        try:
            async with http.stream("POST", url + "/v1/generate", json=body, headers=headers) as r:
                if r.status_code != 200:
                    raise worker_error(r.status_code, await r.aread())
                async for line in r.aiter_lines():
                    if line:
                        inbox.put_nowait(json.loads(line))
            inbox.put_nowait(_END)
        except BaseException as e:  # handed over to the reader
            inbox.put_nowait(e)

    task = asyncio.create_task(pump())
    try:
        while True:
            item = await inbox.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            if "error" in item:
                raise APIError(500, item["error"]["message"], "server_error")
            yield item
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


def worker_error(status: int, raw: bytes) -> APIError:
    try:
        err = json.loads(raw)["error"]
        return APIError(status if status < 500 else 502, err["message"], err.get("type", "server_error"))
    except (ValueError, KeyError, TypeError):
        return APIError(502, f"the worker answered HTTP {status}", "server_error")
