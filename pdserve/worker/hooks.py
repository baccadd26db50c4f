"""What a worker's engine calls at each point of a request (`engine/role.py`): both sides of a
transfer, whatever the worker's role (a role is state: `Worker.change_role`), and its tracing."""

from __future__ import annotations

from pdserve.engine.role import RoleHooks
from pdserve.worker.decode import DecodeRole
from pdserve.worker.prefill import PrefillRole
from pdserve.worker.tracing import WorkerTracing


class WorkerHooks(RoleHooks):
    """A colocated worker that also serves as either side of a transfer (and, with tracing on,
    traces its requests: `tracing.py`)."""

    def __init__(self, decode: DecodeRole, prefill: PrefillRole, tracing: WorkerTracing | None) -> None:
        self.decode, self.prefill, self.tracing = decode, prefill, tracing

    def on_reserved(self, request):
        self.decode.on_reserved(request)

    def before_execute(self, step):
        if self.tracing is not None:
            self.tracing.before_execute(step)
        return self.prefill.before_execute(step)

    def after_execute(self, step):
        self.prefill.after_execute(step)

    def on_finished(self, request):
        self.decode.on_finished(request)
        self.prefill.on_finished(request)
        if self.tracing is not None:
            self.tracing.on_finished(request)
