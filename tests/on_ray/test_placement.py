"""Where `pdserve serve --ray` puts each actor, and the flags it refuses before asking Ray for
anything: pure functions, no Ray needed."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser, engine_argv
from pdserve.on_ray.driver import deployment_spec, describe
from pdserve.on_ray.placement import (
    HEAD_NODE, ROUTER_DEFAULT, Resources, parse_resources, placement_strategy, router_homes, worker_default,
)


def test_resources_as_ray_options_and_bundles():
    r = parse_resources('{"CPU": 4, "GPU": 1, "prefill_node": 1}', worker_default("cpu"), "--prefill-resources")
    assert r == Resources(4.0, 1.0, {"prefill_node": 1.0})
    assert r.actor_options() == {"num_cpus": 4.0, "num_gpus": 1.0, "resources": {"prefill_node": 1.0}}
    assert r.bundle() == {"CPU": 4.0, "GPU": 1.0, "prefill_node": 1.0}
    assert r.threads() == 4
    assert Resources(0.5).threads() == 1  # a fraction of a core still runs one thread
    assert ROUTER_DEFAULT.bundle() == {HEAD_NODE: 0.001}  # no CPU or GPU asked: zero amounts left out


def test_defaults_follow_the_device():
    assert parse_resources(None, worker_default("cuda"), "--decode-resources") == Resources(1.0, 1.0)
    assert parse_resources(None, worker_default("cpu"), "--decode-resources") == Resources(1.0, 0.0)
    assert parse_resources('{"decode_node": 1}', worker_default("cuda:1"), "-x") == Resources(1.0, 1.0, {"decode_node": 1.0})


@pytest.mark.parametrize("text, fragment", [
    ("GPU=1", "takes a JSON object"),
    ("[1, 2]", "JSON object of resource names"),
    ('{"GPU": -1}', "GPU must be a number from 0"),
    ('{"GPU": true}', "GPU must be a number"),
    ('{"GPU": "1"}', "GPU must be a number"),
    ('{"CPU": 1e9}', "CPU must be a number from 0 to 1e+06"),
    ('{"bad name": 1}', "'bad name' is not a resource name"),
    ('{"gpu\\n": 1}', "is not a resource name"),
])
def test_bad_resources_are_refused_naming_the_flag(text, fragment):
    with pytest.raises(ValueError, match="--prefill-resources") as e:
        parse_resources(text, worker_default("cpu"), "--prefill-resources")
    assert fragment in str(e.value)


def test_placement_strategies():
    assert placement_strategy("default") is None
    assert placement_strategy("spread") == "SPREAD" and placement_strategy("strict-spread") == "STRICT_SPREAD"
    with pytest.raises(ValueError, match="--placement takes one of"):
        placement_strategy("everywhere")


def _spec(*flags: str):
    args = build_parser().parse_args(["serve", "--ray", *flags])
    return deployment_spec(args, engine_argv(args))


def test_a_spec_carries_the_secrets_apart_from_every_argv(monkeypatch):
    monkeypatch.setenv("PDSERVE_TOKEN", "the-token-" + "x" * 20)
    spec = _spec("--decode", "2", "--decode-resources", '{"decode_node": 1}', "--placement", "spread")
    assert spec.env["PDSERVE_TOKEN"] == "the-token-" + "x" * 20
    assert spec.pools["decode"] == Resources(1.0, 0.0, {"decode_node": 1.0})
    assert spec.placement == "SPREAD" and spec.router == ROUTER_DEFAULT
    assert "the-token-" not in " ".join(spec.engine_argv) and "the-token-" not in str(spec.args)
    monkeypatch.delenv("PDSERVE_TOKEN")
    assert len(_spec().env["PDSERVE_TOKEN"]) == 64  # none given: a fresh one for this deployment


def test_a_tensor_parallel_pool_asks_a_cpu_and_gpu_per_rank():
    """A worker's ranks are processes on its node: its actor asks for each one's CPU (and GPU)."""
    spec = _spec("--tensor-parallel-size", "2", "--decode-engine-args", "--tensor-parallel-size 4")
    assert spec.pools["prefill"] == Resources(2.0, 0.0) and spec.pools["decode"] == Resources(4.0, 0.0)
    cuda = _spec("--device", "cuda", "--prefill-engine-args=--tensor-parallel-size=2")
    assert cuda.pools["prefill"] == Resources(2.0, 2.0) and cuda.pools["decode"] == Resources(1.0, 1.0)


@pytest.mark.parametrize("flags, fragment", [
    (["--port", "0"], "fixed router --port"),
    (["--pin-cpus"], "--pin-cpus is for one host"),
    (["--host", "0.0.0.0"], "--host is for one host"),
    (["--prefill", "0", "--decode", "0"], "at least one worker"),
    (["--router-resources", "{"], "--router-resources takes a JSON object"),
    (["--routers", "3", "--port", "65533"], "give a lower --port"),
])
def test_flags_refused_before_ray_is_asked(flags, fragment):
    with pytest.raises(ValueError) as e:
        _spec(*flags)
    assert fragment in str(e.value)


def test_every_deployment_event_reads_as_a_sentence():
    assert "Ray starts it again" in describe({"event": "actor_down", "name": "decode worker 1", "node_ip": "10.0.0.2"})
    assert "on 10.0.0.3 (actor restart 1)" in describe(
        {"event": "actor_restarted", "name": "decode worker 1", "node_ip": "10.0.0.3", "restarts": 1})
    assert "gave up after 3 restarts" in describe({"event": "actor_lost", "name": "w", "max_restarts": 3})
    assert describe({"event": "removed", "name": "decode worker 2", "node_ip": "10.0.0.4"}) == \
        "decode worker 2 removed (10.0.0.4)"
    assert "started again (restart 2, pid 7)" in describe(
        {"event": "restarted", "name": "w", "restarts": 2, "pid": 7})  # the in-actor supervisor's, as locally


def test_an_address_where_no_ray_cluster_answers_is_refused_at_once():
    import socket

    from pdserve.on_ray.driver import _connect

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match=f"no Ray cluster answers at 127.0.0.1:{port}"):
        _connect(None, f"127.0.0.1:{port}")  # refused before Ray is asked (it would retry for minutes)


def _node(node_id: str, ip: str, alive: bool = True, **resources) -> dict:
    return {"NodeID": node_id, "NodeManagerAddress": ip, "Alive": alive, "Resources": {"CPU": 1.0, **resources}}


def test_router_replicas_go_to_nodes_of_their_own_head_first():
    nodes = [_node("c", "10.0.0.3"), _node("a", "10.0.0.1", **{HEAD_NODE: 1.0}), _node("b", "10.0.0.2"),
             _node("d", "10.0.0.4", alive=False)]
    assert router_homes(nodes, 2, ROUTER_DEFAULT) == [("a", "10.0.0.1"), ("b", "10.0.0.2")]
    assert router_homes(nodes, 4, ROUTER_DEFAULT) == [("a", "10.0.0.1"), ("b", "10.0.0.2"), ("c", "10.0.0.3"),
                                                      ("a", "10.0.0.1")]  # fewer live nodes than routers: again
    labelled = Resources(0.0, 0.0, {"router_node": 0.01})
    nodes.append(_node("e", "10.0.0.5", router_node=1.0))
    assert router_homes(nodes, 2, labelled) == [("e", "10.0.0.5"), ("e", "10.0.0.5")]  # only where it is asked
    with pytest.raises(ValueError, match="no live Ray node"):
        router_homes(nodes, 1, Resources(0.0, 0.0, {"gpu_router": 1.0}))
