"""`pdserve serve --ray [ADDRESS]` and `pdserve scale`: a pdserve cluster across the nodes of a
running Ray cluster.

`serve --ray` connects to Ray, starts the named `Deployment` actor (on the head node), which
places the router and the workers (`deployment.py`), prints the router's URL once every worker has
registered, then prints every event of the deployment (JSON lines on stdout, sentences on stderr)
until SIGINT/SIGTERM, which stops every actor. `pdserve scale --prefill N --decode M` finds the
deployment by its name and changes its pools while it serves.

Ray's own channels (the actors' arguments, the cluster's secrets among them) are Ray's: run Ray
on a private network, as its documentation asks. pdserve's own traffic (HTTP, KV) keeps its rules.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import sys
import threading

from pdserve.credentials import ADMIN_KEY_ENV, API_KEY_ENV, TOKEN_ENV, read_secret
from pdserve.launcher import describe_event, pool_tensor_parallel
from pdserve.layout import Layout, from_flags
from pdserve.on_ray.placement import ROUTER_DEFAULT, parse_resources, placement_strategy, worker_default

NAMESPACE = "pdserve"


def add_ray_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("on a Ray cluster (pip install 'pdserve[ray]')")
    g.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                   help="place the router and the workers as actors on this Ray cluster (default address: auto, "
                        "the cluster this node belongs to)")
    g.add_argument("--name", default="pdserve", help="the deployment's name on Ray (for `pdserve scale`)")
    g.add_argument("--prefill-resources", default=None, metavar="JSON",
                   help="what one prefill worker asks of its node, e.g. '{\"GPU\": 1, \"prefill_node\": 1}' "
                        "(default: one CPU, and a GPU with --device cuda)")
    g.add_argument("--decode-resources", default=None, metavar="JSON", help="the same for a decode worker")
    g.add_argument("--colocated-resources", default=None, metavar="JSON", help="the same for a colocated worker")
    g.add_argument("--router-resources", default=None, metavar="JSON",
                   help="the same for the router (default: a little of the head node, so its address stays)")
    g.add_argument("--placement", default="default", choices=["default", "spread", "strict-spread", "pack"],
                   help="each pool's workers in one Ray placement group of this strategy (default: none)")
    g.add_argument("--max-actor-restarts", type=int, default=-1,
                   help="times Ray starts an actor again after its node is lost (-1: no limit)")


def _connect(ray, address: str) -> None:
    """Join the Ray cluster at `address` (`auto`: this node's), or ValueError saying none answers
    (Ray itself would retry an address nobody listens on for minutes)."""
    host, _, port = address.rpartition(":")
    if address != "auto" and port.isdigit():
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        except OSError as e:
            raise ValueError(f"no Ray cluster answers at {address}: {e.strerror or e}") from None
    try:
        ray.init(address=address, namespace=NAMESPACE, logging_level="WARNING")
    except ConnectionError as e:
        raise ValueError(f"cannot join a Ray cluster at {address}: {e}") from None


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray installed: pip install 'pdserve[ray]'") from None
    return ray


def deployment_spec(args: argparse.Namespace, engine_argv: list[str]):
    """What the deployment needs, every flag checked here, before Ray is asked for anything."""
    from pdserve.on_ray.deployment import DeploymentSpec

    # a Ray cluster's nodes are not this host: without layout flags, one prefill and one decode worker
    pools = from_flags(args.prefill, args.decode, args.colocated) or Layout(1, 1, 0, "on Ray: 1P1D")
    args.prefill, args.decode, args.colocated = pools.prefill, pools.decode, pools.colocated
    if args.port == 0:
        raise ValueError("--ray needs a fixed router --port: workers on other nodes keep its address")
    if args.routers > 1 and args.port + args.routers > 65535:
        raise ValueError(f"--routers {args.routers} on Ray takes ports --port to --port + {args.routers} (each "
                         f"router's own is --port + 1 + its number): give a lower --port")
    if args.host != "127.0.0.1":
        raise ValueError("--host is for one host: on Ray, each process binds to and advertises its node's address")
    if args.pin_cpus:
        raise ValueError("--pin-cpus is for one host; on Ray, give each pool its CPUs with --prefill-resources "
                         "and --decode-resources")
    device = args.device or "cpu"
    pools = {pool: parse_resources(getattr(args, f"{flag}_resources"),
                                   worker_default(device, pool_tensor_parallel(args, pool)), f"--{flag}-resources")
             for pool, flag in (("prefill", "prefill"), ("decode", "decode"), ("both", "colocated"))}
    env = {TOKEN_ENV: read_secret(args.token_file, TOKEN_ENV) or secrets.token_hex(32),
           API_KEY_ENV: read_secret(args.api_key_file, API_KEY_ENV),
           ADMIN_KEY_ENV: read_secret(args.admin_key_file, ADMIN_KEY_ENV)}
    flags = {k: v for k, v in vars(args).items() if k != "func"}
    return DeploymentSpec(
        args=flags, engine_argv=engine_argv, env=env,
        router=parse_resources(args.router_resources, ROUTER_DEFAULT, "--router-resources"), pools=pools,
        placement=placement_strategy(args.placement), max_actor_restarts=args.max_actor_restarts,
        policy={"max_backoff_s": args.max_restart_backoff})


def run_serve_on_ray(args: argparse.Namespace, engine_argv: list[str]) -> int:
    spec = deployment_spec(args, engine_argv)
    ray = _import_ray()
    from pdserve.on_ray.deployment import Deployment
    from pdserve.on_ray.placement import HEAD_NODE

    say = lambda msg: print(f"[pdserve serve --ray] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    out = _events_only_stdout()
    _connect(ray, args.ray)
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        deployment = ray.remote(Deployment).options(
            name=args.name, num_cpus=0, resources={HEAD_NODE: 0.001}, max_concurrency=16).remote(spec)
    except ValueError:
        raise ValueError(f"a deployment named {args.name!r} already runs on this Ray cluster: stop it, scale it "
                         f"(`pdserve scale --name {args.name}`) or choose another --name") from None
    code, seen = 0, 0
    try:
        info = ray.get(deployment.start.remote())
        print(json.dumps({"event": "ready", "url": info["url"], "model": info["model"], "actors": info["members"]}),
              file=out, flush=True)
        for m in info["members"]:
            say(f"{m['name']} on {m['node_ip']} (node {m['node_id'][:12]}) at {m['url']}")
        say(f"ready at {info['url']}; scale with: pdserve scale --name {args.name} --prefill N --decode M")
        while not stopping.wait(1.0):
            for event in ray.get(deployment.events_since.remote(seen)):
                print(json.dumps(event), file=out, flush=True)
                say(describe(event))
                seen += 1
    except ray.exceptions.RayError as e:
        say(f"the deployment failed: {getattr(e, 'cause', None) or e}")
        code = 1
    finally:
        say("stopping")
        try:
            ray.get(deployment.stop.remote(15.0), timeout=60)
        except ray.exceptions.RayError:
            pass  # the deployment is gone already: its actors went with it
        ray.kill(deployment)
        print(json.dumps({"event": "stopped"}), file=out, flush=True)
    return code


def _events_only_stdout():
    """Standard output for this command's JSON lines alone: what Ray (or a library under it) writes
    to file descriptor 1, such as the actors' forwarded output, goes to standard error instead."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return out


def describe(event: dict) -> str:
    kind, name, where = event["event"], event["name"], event.get("node_ip", "?")
    if kind == "actor_down":
        return f"{name}'s actor is down with its node {where}: Ray starts it again where it fits"
    if kind == "actor_restarted":
        return f"{name} started again by Ray on {where} (actor restart {event['restarts']})"
    if kind == "actor_lost":
        return f"{name} is lost: Ray gave up after {event['max_restarts']} restarts; `pdserve scale` adds another"
    if kind in ("added", "draining", "removed"):
        return f"{name} {kind} ({where})"
    return describe_event(event)


def add_scale_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray", default="auto", metavar="ADDRESS", help="the Ray cluster (default: auto)")
    p.add_argument("--name", default="pdserve", help="the deployment's name (`pdserve serve --ray --name`)")
    for pool in ("prefill", "decode", "colocated"):
        p.add_argument(f"--{pool}", type=int, default=None, metavar="N", help=f"{pool} workers wanted")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds new workers have to be ready (no node with their resources free: an error)")


def run_scale(args: argparse.Namespace) -> int:
    wanted = {pool: n for pool, n in (("prefill", args.prefill), ("decode", args.decode), ("both", args.colocated))
              if n is not None}
    if not wanted:
        raise ValueError("say how many workers a pool should have: --prefill N, --decode N or --colocated N")
    if any(n < 0 or n > 1024 for n in wanted.values()):
        raise ValueError("a pool's size is from 0 to 1024")
    ray = _import_ray()
    _connect(ray, args.ray)
    try:
        deployment = ray.get_actor(args.name, namespace=NAMESPACE)
    except ValueError:
        raise ValueError(f"no pdserve deployment named {args.name!r} runs on this Ray cluster") from None
    try:
        members = ray.get(deployment.scale.remote(wanted, args.timeout))
    except ray.exceptions.RayTaskError as e:
        raise ValueError(str(e.cause)) from None
    print(json.dumps({"event": "scaled", "actors": members}), flush=True)
    for m in members:
        print(f"{m['name']:<18} {m['state']:<9} {m['node_ip']:<16} {m['url']}", file=sys.stderr)
    return 0
