"""The routing decision without a model or a network: fallbacks, exclusion, room, conditional
disaggregation, prefix-aware choice across block sizes; then the router applying it to workers
that registered their block sizes."""

import pytest
from fastapi.testclient import TestClient

from pdserve.prefix_hash import block_hashes
from pdserve.router import routing
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.router import Router
from pdserve.router.policy import DisaggregationPolicy, PrefixIndex, WorkerLoad
from pdserve.router.routing import Candidate, NoRoom, NoWorker, route
from pdserve.router.streams import NoRoom as RouterNoRoom
from pdserve.wire import WorkerStats

POLICY = DisaggregationPolicy(min_remote_tokens=32, saturated_queue_tokens=1000)


def worker(worker_id: str, role: str, block_size: int = 16, has_room: bool = True, **load) -> Candidate:
    return Candidate(worker_id, role, WorkerLoad(**{"kv_blocks_total": 100, **load}), has_room, block_size)


def prompt(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def record(index: PrefixIndex, decision: routing.RoutingDecision) -> None:
    for r in decision.records:
        index.record(r.worker_id, r.block_size, r.hashes)


def test_prefill_workers_serve_colocated_when_no_decode_worker_lives():
    workers = [worker("p1", "prefill", waiting=5), worker("p2", "prefill")]
    got = route(workers, prompt(100), PrefixIndex(), policy=POLICY)
    assert (got.decode_id, got.prefill_id) == ("p2", None)  # and no worker prefills for another
    assert (got.decode_uncached, got.prefill_uncached) == (100, 0)
    # a decode worker that failed the request counts as none: prefill workers take over
    got = route([worker("d", "decode"), *workers], prompt(100), PrefixIndex(), policy=POLICY, exclude=frozenset({"d"}))
    assert (got.decode_id, got.prefill_id) == ("p2", None)
    with pytest.raises(NoWorker):
        route([], prompt(100), PrefixIndex())
    with pytest.raises(NoWorker):
        route(workers, prompt(100), PrefixIndex(), exclude=frozenset({"p1", "p2"}))


def test_excluded_workers_do_not_decode():
    workers = [worker("idle", "decode"), worker("busy", "both", running=30)]
    assert route(workers, prompt(10), PrefixIndex()).decode_id == "idle"
    assert route(workers, prompt(10), PrefixIndex(), exclude=frozenset({"idle"})).decode_id == "busy"


def test_no_room_is_not_no_worker():
    full = [worker("d1", "decode", has_room=False), worker("d2", "decode", has_room=False), worker("p", "prefill")]
    with pytest.raises(NoRoom):  # the request waits for room; prefill workers do not take over
        route(full, prompt(100), PrefixIndex(), policy=POLICY)
    some_room = [worker("idle", "decode", has_room=False), worker("busy", "decode", running=30)]
    assert route(some_room, prompt(10), PrefixIndex()).decode_id == "busy"


def test_a_prefill_worker_only_when_the_uncached_part_is_worth_it():
    index = PrefixIndex()
    workers = [worker("d", "decode"), worker("p", "prefill")]
    short = route(workers, prompt(16), index, policy=POLICY)
    assert (short.prefill_id, short.decode_uncached) == (None, 16)
    long = route(workers, prompt(100), index, policy=POLICY)
    assert (long.prefill_id, long.decode_uncached, long.prefill_uncached) == ("p", 100, 100)
    assert [(r.worker_id, r.block_size) for r in long.records] == [("d", 16), ("p", 16)]
    # the decode worker holds all but the last 20 tokens: it computes those itself
    index.record("d", 16, block_hashes(prompt(100), 16)[:5])
    cached = route(workers, prompt(100), index, policy=POLICY)
    assert (cached.prefill_id, cached.decode_uncached) == (None, 20)
    assert [r.worker_id for r in cached.records] == ["d"]
    saturated = [worker("d", "decode"), worker("p", "prefill", queued_prefill_tokens=1000)]
    assert route(saturated, prompt(100, start=500), index, policy=POLICY).prefill_id is None


def test_the_prefill_worker_holding_the_prefix_wins_over_a_shorter_queue():
    index = PrefixIndex()
    text = prompt(200)
    index.record("warm", 16, block_hashes(text, 16)[:10])  # 160 tokens cached
    workers = [worker("d", "decode"), worker("warm", "prefill", queued_prefill_tokens=100),
               worker("cold", "prefill", queued_prefill_tokens=50)]
    got = route(workers, text, index, policy=POLICY)
    assert (got.prefill_id, got.prefill_uncached) == ("warm", 40)  # 100 + 40 < 50 + 200
    assert route(workers, prompt(200, start=1000), index, policy=POLICY).prefill_id == "cold"


def test_repeated_prompts_find_their_worker_whatever_its_block_size(monkeypatch):
    calls = []
    monkeypatch.setattr(routing, "block_hashes", lambda ids, size: calls.append(size) or block_hashes(ids, size))
    index = PrefixIndex()
    a, b = prompt(256), prompt(256, start=5000)
    quiet = {"p8": 0, "p16": 0}

    def send(text: list[int], queued: dict[str, int]) -> str:
        workers = [worker("d", "decode"), *(worker(k, "prefill", int(k[1:]), queued_prefill_tokens=n)
                                            for k, n in queued.items())]
        decision = route(workers, text, index, policy=POLICY)
        record(index, decision)
        return decision.prefill_id

    assert send(a, quiet) == "p16"  # a tie in work: the first by id
    assert send(b, {**quiet, "p16": 500}) == "p8"
    assert sorted(calls[:2]) == [8, 16] and len(calls) == 4  # once per block size for each prompt
    # each conversation's next turn goes back to the worker holding its prefix, though the other's
    # queue is shorter (the decode worker holds the prefix too, but the new turn is worth sending)
    turn = prompt(100, start=20_000)
    assert send(a + turn, {"p8": 0, "p16": 100}) == "p16"  # 100 + 100 < 0 + 356
    assert send(b + turn, {"p8": 100, "p16": 0}) == "p8"
    assert index.cached_tokens("p8", 8, block_hashes(b + turn, 8)) == 352
    assert index.cached_tokens("p16", 16, block_hashes(a + turn, 16)) == 352


def test_the_router_routes_by_the_block_size_each_worker_registered():
    router = Router(RouterConfig(model_name="tiny", max_model_len=4096), None, "m" * 64, 50_000)
    client = TestClient(create_app(router))
    ids = {}
    for name, role, size in (("d", "decode", 16), ("p8", "prefill", 8), ("p16", "prefill", 16)):
        body = {"url": f"http://127.0.0.1:{len(ids) + 1}", "role": role, "model_hash": "m" * 64, "block_size": size}
        ids[name] = client.post("/internal/register", json=body).json()["worker_id"]
    assert {w.worker_id: w.block_size for w in router.registry.workers()} == {
        ids["d"]: 16, ids["p8"]: 8, ids["p16"]: 16}
    for size in (0, 12, 2048):
        body = {"url": "http://127.0.0.1:9", "role": "decode", "model_hash": "m" * 64, "block_size": size}
        refused = client.post("/internal/register", json=body)
        assert refused.status_code == 400 and "block_size" in refused.text

    for node in ("n\n", "a/b", "n" * 129):  # a node name out of bounds is refused, naming the field
        body = {"url": "http://127.0.0.1:9", "role": "decode", "model_hash": "m" * 64, "node": node}
        refused = client.post("/internal/register", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "node"
    body = {"url": "http://127.0.0.1:9", "role": "decode", "model_hash": "m" * 64, "node": "ray-0a1b@10.0.0.7"}
    named = client.post("/internal/register", json=body).json()["worker_id"]
    assert router.registry.get(named).node == "ray-0a1b@10.0.0.7"  # what /admin/workers shows as `node`
    router.registry.remove(named)

    def heartbeats(queued: dict[str, int], **stats) -> None:
        for name, worker_id in ids.items():
            router.registry.heartbeat(worker_id, WorkerStats(kv_blocks_total=100,
                                                              queued_prefill_tokens=queued.get(name, 0), **stats))

    first, second, turn = prompt(600), prompt(600, start=9000), prompt(300, start=20_000)
    d, p = router.route(first)
    assert p.worker_id == ids["p8"] and d.in_flight == 1  # a tie in work: the first by id
    assert router.index.cached_tokens(ids["p8"], 8, block_hashes(first, 8)) == 600
    # p8 has the first prompt queued (routed since its last heartbeat): the second goes to p16
    assert router.route(second)[1].worker_id == ids["p16"]
    assert router.index.cached_tokens(ids["p16"], 16, block_hashes(second, 16)) == 592
    # each conversation's next turn goes back to the worker holding its prefix, the busier one
    heartbeats({"p8": 300})
    assert router.route(first + turn)[1].worker_id == ids["p8"]  # 300 + 300 < 0 + 900
    heartbeats({"p16": 300})
    assert router.route(second + turn)[1].worker_id == ids["p16"]  # 300 + 308 < 0 + 900
    assert d.in_flight == 4
    heartbeats({}, capacity=4)
    with pytest.raises(RouterNoRoom):  # the decode worker holds as many sequences as it said it can
        router.route(first)


def test_a_worker_whose_heartbeat_says_it_is_draining_is_never_chosen():
    from pdserve.http_errors import APIError

    router = Router(RouterConfig(model_name="tiny", max_model_len=4096), None, "m" * 64, 50_000)
    client = TestClient(create_app(router))
    ids = {}
    for name, role in (("d1", "decode"), ("d2", "decode"), ("p", "prefill")):
        body = {"url": f"http://127.0.0.1:{len(ids) + 1}", "role": role, "model_hash": "m" * 64, "block_size": 16}
        ids[name] = client.post("/internal/register", json=body).json()["worker_id"]
    names = {worker_id: name for name, worker_id in ids.items()}

    def beat(draining: set[str]) -> None:
        for name, worker_id in ids.items():
            router.registry.heartbeat(worker_id, WorkerStats(kv_blocks_total=100, draining=name in draining))

    beat(set())
    d, p = router.route(prompt(600))
    assert p is not None and p.worker_id == ids["p"]
    first = names[d.worker_id]
    other = "d2" if first == "d1" else "d1"
    beat({first})  # its own 503s would make the router retry quietly; it is not asked at all
    for start in (10_000, 20_000, 30_000):  # new prompts: no prefix pulls them anywhere
        d, p = router.route(prompt(600, start=start))
        assert d.worker_id == ids[other] and p.worker_id == ids["p"]
    beat({first, "p"})  # no prefill worker to take the prompt: the decode worker computes it
    d, p = router.route(prompt(600, start=40_000))
    assert d.worker_id == ids[other] and p is None
    beat(set(ids))
    with pytest.raises(APIError) as refused:
        router.route(prompt(600, start=50_000))
    assert refused.value.status == 503
