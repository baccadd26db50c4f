"""The one way a test waits for something that happens on another thread or in another process."""

from __future__ import annotations

import time
from typing import Callable


def wait_for(predicate: Callable[[], object], timeout: float, what: str, *,
             state: Callable[[], object] | None = None, interval: float = 0.02) -> None:
    """Poll `predicate` until it is true. Past `timeout` seconds, fail naming `what` was awaited,
    with `state()` (when given) in the message: the part of the world that tells why it never came."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            shown = f": {state()}" if state is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{shown}")
        time.sleep(interval)
