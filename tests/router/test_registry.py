"""The worker registry: tokens, one model per cluster, leases renewed by heartbeats and expired."""

import pytest

from pdserve.router.registry import RegistrationError, Registry


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_register_heartbeat_expire():
    clock = Clock()
    reg = Registry("m" * 64, token="t", lease_s=5, clock=clock)
    d = reg.register("http://127.0.0.1:1", "decode", "m" * 64, "t")
    p = reg.register("http://127.0.0.1:2", "prefill", "m" * 64, "t")
    both = reg.register("http://127.0.0.1:3", "both", "m" * 64, "t")
    assert [e.worker_id for e in reg.workers("decode")] == [d.worker_id, both.worker_id]
    assert [e.worker_id for e in reg.workers("prefill")] == [p.worker_id, both.worker_id]
    clock.now += 4
    reg.heartbeat(d.worker_id, {"running": 7, "kv_blocks_total": 10}, "t")
    clock.now += 2  # p and both missed their lease, d renewed it
    assert {e.worker_id for e in reg.expire()} == {p.worker_id, both.worker_id}
    assert [e.worker_id for e in reg.workers()] == [d.worker_id] and reg.get(d.worker_id).load.running == 7
    with pytest.raises(KeyError):
        reg.heartbeat(p.worker_id, {}, "t")  # expired: it must register again


@pytest.mark.parametrize("kwargs, message", [
    (dict(token="wrong"), "bad token"),
    (dict(model_hash="x" * 64), "model mismatch"),
    (dict(role="router"), "role must be"),
])
def test_refusals(kwargs, message):
    reg = Registry("m" * 64, token="t")
    args = dict(url="http://127.0.0.1:1", role="decode", model_hash="m" * 64, token="t")
    args.update(kwargs)
    with pytest.raises(RegistrationError, match=message):
        reg.register(**args)
    assert reg.workers() == []


def test_a_restarted_worker_replaces_its_entry():
    reg = Registry("m")
    first = reg.register("http://127.0.0.1:1", "decode", "m")
    second = reg.register("http://127.0.0.1:1", "decode", "m")
    assert [e.worker_id for e in reg.workers()] == [second.worker_id] and first.worker_id != second.worker_id
