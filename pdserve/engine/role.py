"""Hooks through which a worker role changes what the shared engine does.

The colocated engine uses the defaults, which change nothing. A prefill worker ships each layer's
KV as soon as the layer is computed and stops a request after its first token; a decode worker
leases reserved blocks to a prefill worker and admits the request once its KV landed.
"""

from __future__ import annotations

from typing import Callable

from pdserve.engine.request import Request
from pdserve.engine.step import SchedulerOutput


class RoleHooks:
    def on_reserved(self, request: Request) -> None:
        """Blocks for a remote-prefill request's prompt were reserved (status WAITING_FOR_KV)."""

    def before_execute(self, step: SchedulerOutput) -> Callable[[int], None] | None:
        """Called before the model runs a step; may return a function called with each layer's
        index as soon as that layer's KV for the step is written."""
        return None

    def after_execute(self, step: SchedulerOutput) -> None:
        """Called after the model ran a step, before its results are applied (and blocks freed)."""

    def on_finished(self, request: Request) -> None:
        """Called once, when the request reaches a finished status, before its blocks are freed."""
