"""A prefill worker renews the leases of prompts that began and sit a step out (paused for a more
urgent one), at most every RENEW_EVERY_S; never one that has not begun, nor one in the step."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.engine.step import SchedulerOutput
from pdserve.kv_transfer.base import Lease
from pdserve.worker import prefill as prefill_module
from pdserve.worker.prefill import PrefillRole, Shipment


class _Sender:
    alive = True

    def __init__(self) -> None:
        self.renewed: list[int] = []

    def renew(self, lease: Lease) -> None:
        self.renewed.append(lease.fence)


def test_paused_prompts_renew_their_leases(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(prefill_module.time, "monotonic", lambda: clock[0])
    role = PrefillRole({}, [])
    requests = {f"r{i}@{i}": SimpleNamespace(request_id=f"r{i}@{i}", num_computed_tokens=computed)
                for i, computed in enumerate((64, 0, 32))}
    role.engine = SimpleNamespace(scheduler=SimpleNamespace(requests=requests))
    sender = _Sender()
    for i, engine_id in enumerate(requests):
        role.shipments[engine_id] = Shipment(sender, Lease(f"r{i}", i, [0], 16, 0, 128, 0.0), 0, {}, "auto")
    step = SchedulerOutput()
    step.requests.append(requests["r2@2"])  # computing this step: not paused
    role._renew_paused(step)
    assert sender.renewed == [0]  # r0 began and sits out; r1 has not begun
    clock[0] += prefill_module.RENEW_EVERY_S / 2
    role._renew_paused(step)
    assert sender.renewed == [0]
    clock[0] += prefill_module.RENEW_EVERY_S
    role._renew_paused(SchedulerOutput())
    assert sender.renewed == [0, 0, 2] and role.num_renewed == 3
