"""Hooks through which a worker role changes what the shared scheduler does.

The colocated engine uses the defaults, which change nothing. A prefill worker stops a request
after its first token and ships its KV; a decode worker admits a request only once its KV landed.
"""

from __future__ import annotations

from pdserve.engine.request import Request


class RoleHooks:
    def can_schedule(self, request: Request) -> bool:
        """May this waiting request be scheduled now?"""
        return True

    def on_computed(self, request: Request, num_new_tokens: int) -> None:
        """Called after a step computed KV for `num_new_tokens` more tokens of the request."""

    def on_finished(self, request: Request) -> None:
        """Called once, when the request reaches a finished status, before its blocks are freed."""
