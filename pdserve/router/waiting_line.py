"""Requests the router admitted that wait for a decode worker with room, first come, first served.

The router sends a worker no more sequences than its heartbeat says it holds (running + queued);
the rest wait here, not in an error. A request waits for its turn: it is woken when a sequence
ends somewhere (`release`), tries to route, and waits again if there is still no room; every
second it tries anyway (heartbeats bring new workers and capacities).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class WaitingLine:
    def __init__(self) -> None:
        self._turns: collections.deque[asyncio.Future] = collections.deque()

    def __len__(self) -> int:
        return len(self._turns)

    async def wait(self, try_route: Callable[[], T | None], deadline: float, gave_up: Callable[[], Exception]) -> T:
        """`try_route()`'s first answer other than None; `gave_up()` is raised at `deadline`."""
        turn = asyncio.get_running_loop().create_future()
        self._turns.append(turn)
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise gave_up()
                choice = try_route()
                if choice is not None:
                    return choice
                turn = self._renew(turn)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(turn), min(1.0, remaining))
        finally:
            with contextlib.suppress(ValueError):
                self._turns.remove(turn)
            self._wake_next()  # whatever room this one did not take, the next may

    def release(self, worker: Any, sequences: int) -> None:
        """`sequences` ended on `worker`: the first request waiting may go."""
        worker.in_flight = max(0, worker.in_flight - sequences)
        self._wake_next()

    def _renew(self, turn: asyncio.Future) -> asyncio.Future:
        if not turn.done():
            return turn
        fresh = asyncio.get_running_loop().create_future()
        self._turns[self._turns.index(turn)] = fresh
        return fresh

    def _wake_next(self) -> None:
        for turn in self._turns:
            if not turn.done():
                turn.set_result(None)
                return


class Hold:
    """Sequence slots a request holds on a decode worker, let go exactly once (idempotent)."""

    def __init__(self, line: WaitingLine, worker: Any, sequences: int) -> None:
        self._line, self._worker, self._sequences = line, worker, sequences

    def release(self) -> None:
        if self._worker is not None:
            self._line.release(self._worker, self._sequences)
            self._worker = None


@dataclass(eq=False)
class Admitted:
    """A request's first workers, chosen with room (`Router.admit`), and its hold on the decode
    worker: its stream's first call lets it go when it ends; a stream that never starts (the client
    left first) leaves it to `release`, which after the stream is a no-op."""

    decode: Any
    prefill: Any
    deadline: float  # time.monotonic() until which the request may still wait for room, in all
    hold: Hold

    def release(self) -> None:
        self.hold.release()
