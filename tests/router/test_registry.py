"""The worker registry: tokens, one model per cluster, leases renewed by heartbeats and expired."""

import pytest

from pdserve.router.registry import RegistrationError, Registry
from pdserve.wire import WorkerStats


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
    reg.heartbeat(d.worker_id, WorkerStats(running=7, kv_blocks_total=10), "t")
    clock.now += 2  # p and both missed their lease, d renewed it
    assert {e.worker_id for e in reg.expire()} == {p.worker_id, both.worker_id}
    assert [e.worker_id for e in reg.workers()] == [d.worker_id] and reg.get(d.worker_id).load.running == 7
    with pytest.raises(KeyError):
        reg.heartbeat(p.worker_id, WorkerStats(), "t")  # expired: it must register again


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
    assert not first.rejoined and second.rejoined  # what the crash-loop alert counts


def test_a_worker_back_after_its_lease_lapsed_is_a_rejoin_and_the_known_addresses_stay_bounded(monkeypatch):
    monkeypatch.setattr("pdserve.router.registry.MAX_SEEN_URLS", 3)
    clock = Clock()
    reg = Registry("m", lease_s=5, clock=clock)
    reg.register("http://127.0.0.1:1", "decode", "m")
    clock.now += 6
    assert len(reg.expire()) == 1 and reg.register("http://127.0.0.1:1", "decode", "m").rejoined
    for port in (2, 3, 4):  # pushes port 1, the oldest address, out of memory
        assert not reg.register(f"http://127.0.0.1:{port}", "prefill", "m").rejoined
    assert not reg.register("http://127.0.0.1:1", "decode", "m").rejoined


def test_requests_routed_between_heartbeats_count_in_the_load():
    from pdserve.router.policy import choose_decode, choose_prefill

    reg = Registry("m" * 64, token="t")
    a, b = (reg.register(f"http://127.0.0.1:{i}", "both", "m" * 64, "t") for i in (1, 2))
    for w in (a, b):
        reg.heartbeat(w.worker_id, WorkerStats(running=1, kv_blocks_total=100), "t")
    # a burst before the next heartbeat: each request goes where the last one did not
    chosen = []
    for _ in range(4):
        w = choose_decode({e.worker_id: e.current_load() for e in reg.workers("decode")})
        chosen.append(w)
        reg.note_routed(w, 500)
    assert sorted(chosen) == sorted([a.worker_id, b.worker_id] * 2)
    load = reg.get(a.worker_id).current_load()
    assert (load.running, load.waiting, load.queued_prefill_tokens) == (1, 2, 1000)
    reg.note_routed(a.worker_id, 0, remote=True)  # decodes once another worker sends the KV
    assert reg.get(a.worker_id).current_load().sessions == 2
    reg.heartbeat(a.worker_id, WorkerStats(running=3, waiting=1, kv_blocks_total=100), "t")
    assert reg.get(a.worker_id).current_load() == reg.get(a.worker_id).load  # the worker reports them now
    # prefill workers: queued prompt tokens steer the next prompt elsewhere
    p1, p2 = (reg.register(f"http://127.0.0.1:{i}", "prefill", "m" * 64, "t") for i in (3, 4))
    reg.note_routed(p1.worker_id, 4000)
    loads = {e.worker_id: e.current_load() for e in reg.workers("prefill") if e.role == "prefill"}
    assert choose_prefill(loads, {}, 1000) == p2.worker_id
    reg.note_routed("gone", 10)  # a worker that left: nothing to count


def test_each_version_serves_one_model_and_only_a_non_stable_one_may_serve_another():
    reg = Registry("m" * 64)
    with pytest.raises(RegistrationError, match="model mismatch"):  # a first version must be the router's model
        reg.register("http://127.0.0.1:1", "decode", "x" * 64, version="v1")
    reg.register("http://127.0.0.1:1", "decode", "m" * 64, version="v1")
    other = reg.register("http://127.0.0.1:2", "decode", "x" * 64, version="v2", new_model_ok=True)
    assert other.version == "v2" and reg.model_of("v2") == "x" * 64 and reg.versions() == {"v1", "v2"}
    with pytest.raises(RegistrationError, match="version 'v2' serves"):  # a version is one model
        reg.register("http://127.0.0.1:3", "decode", "m" * 64, version="v2", new_model_ok=True)
    with pytest.raises(RegistrationError, match="the cluster serves"):
        reg.register("http://127.0.0.1:4", "decode", "x" * 64, new_model_ok=True)  # unlabelled: the router's
    assert [w.worker_id for w in reg.workers("decode", "v2")] == [other.worker_id]
