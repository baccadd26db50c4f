"""One request's outputs on their way from the engine thread to its HTTP response.

- The engine thread hands outputs over without ever waiting (`sink`). The outputs of one step, for
  every request, reach the server's event loop in one wake-up (`_Handoff`), not one each: each
  wake-up is a write to the loop's pipe and a turn of the loop that must take the GIL from the
  engine thread.
- The response reads them as NDJSON lines; while none comes it sends an empty line every
  `keepalive_s`, so the router can tell a silent worker from a queued request, and ends with an
  error line if the engine stopped.
- A reader that falls `max_pending` outputs behind (a client that stopped reading) is cut off:
  the request is aborted and its buffered outputs dropped, so one slow reader never holds the
  worker's memory.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import AsyncIterator, Callable

from pdserve.outputs import RequestOutput
from pdserve.wire import CompletionDelta, OutputLine, TokenLogprob, encode, error_line

MAX_PENDING_OUTPUTS = 1024
KEEPALIVE_S = 5.0


def output_line(out: RequestOutput) -> bytes:
    """Token ids only: the router makes the text."""
    return encode(OutputLine(
        request_id=out.request_id,
        outputs=[CompletionDelta(index=c.index, token_ids=c.delta_token_ids, finish_reason=c.finish_reason,
                                 logprobs=[TokenLogprob(e.token_id, e.logprob, e.top) for e in c.delta_logprobs]
                                 if c.delta_logprobs else None)
                 for c in out.outputs],
        finished=out.finished,
        num_prompt_tokens=len(out.prompt_token_ids),
        num_cached_tokens=out.num_cached_tokens,
        phase_times=out.phase_times or None,
        prompt_logprobs=[e and TokenLogprob(e.token_id, e.logprob, e.top) for e in out.prompt_logprobs]
        if out.prompt_logprobs is not None else None,
    )) + b"\n"


class _Handoff:
    """Outputs on their way to one event loop: the engine thread adds them, and the first added
    since the loop last took them wakes the loop, which takes them all."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[OutputStream, RequestOutput | BaseException]] = []

    def add(self, stream: OutputStream, item: RequestOutput | BaseException) -> None:
        with self._lock:
            self._pending.append((stream, item))
            if len(self._pending) > 1:
                return  # the loop is woken already and has not taken them yet
        try:
            self._loop.call_soon_threadsafe(self._take)
        except RuntimeError:  # the loop has closed (the worker is stopping): nobody reads
            if not self._loop.is_closed():
                raise
            with self._lock:
                self._pending.clear()

    def _take(self) -> None:
        with self._lock:
            taken, self._pending = self._pending, []
        for stream, item in taken:
            stream._put(item)


_handoffs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Handoff] = weakref.WeakKeyDictionary()
_handoffs_lock = threading.Lock()


def _handoff(loop: asyncio.AbstractEventLoop) -> _Handoff:
    with _handoffs_lock:
        handoff = _handoffs.get(loop)
        if handoff is None:
            handoff = _handoffs[loop] = _Handoff(loop)
        return handoff


class OutputStream:
    def __init__(self, loop: asyncio.AbstractEventLoop, abort: Callable[[], None],
                 max_pending: int = MAX_PENDING_OUTPUTS) -> None:
        self._handoff = _handoff(loop)
        self._abort = abort  # ends the request on the engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.max_pending = max_pending
        self.overflowed = False

    def sink(self, item: RequestOutput | BaseException) -> None:
        """Engine thread: never blocks (beyond a lock held for an append). After the server's loop
        has closed (the worker is stopping) nobody reads: the item is dropped."""
        self._handoff.add(self, item)

    def _put(self, item: RequestOutput | BaseException) -> None:
        if self.overflowed:
            return
        if self._queue.qsize() >= self.max_pending:
            self.overflowed = True
            self._abort()
            while not self._queue.empty():
                self._queue.get_nowait()
        self._queue.put_nowait(item)

    async def lines(self, keepalive_s: float, engine_alive: Callable[[], bool]) -> AsyncIterator[bytes]:
        """The request's NDJSON lines until it finishes; leaving early aborts it."""
        finished = False
        try:
            while not finished:
                try:
                    item = await asyncio.wait_for(self._queue.get(), keepalive_s)
                except asyncio.TimeoutError:
                    if not engine_alive():
                        yield error_line("the worker's engine stopped")
                        return
                    yield b"\n"  # still here: the request waits its turn
                    continue
                if self.overflowed:
                    yield error_line(f"the reader fell {self.max_pending} outputs behind; request aborted",
                                     429, "rate_limit_error")
                    return
                if isinstance(item, BaseException):
                    yield error_line("the engine failed while running this request")
                    return
                finished = item.finished
                yield output_line(item)
        finally:
            if not finished:  # the client went away, or fell behind: abort
                self._abort()
