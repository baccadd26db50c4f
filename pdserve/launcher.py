"""`pdserve serve`: the one-command local cluster, router and workers as supervised child processes.

Lifecycle:
1. Start the router (the worker token given, else a fresh one for this cluster), wait for its ready line.
2. Start the workers (N prefill, M decode, K colocated) registered with it, each with its share of
   the cores (pinned with `--pin-cpus`), and show progress until every one is ready and registered.
   A child that fails here fails the start: the command exits 1 (a wrong flag or model shows at once).
3. Print the URL and an example request, then supervise (`supervisor.py`): a child that exits is
   started again after a backoff, and a crash loop is reported, never given up on in silence. The
   router comes back on the same address, and the workers register with it again on their next
   heartbeat; while a pool is empty the router serves colocated on the survivors. A worker sent
   SIGTERM drains (finishes its requests, leaves the router) and exits 0: it is started again, so
   SIGTERM to each worker in turn is a rolling restart. Nothing a child does ends this command.
   Every exit, restart, restarted child ready again, and crash loop is a JSON line on stdout.
4. On SIGINT/SIGTERM: stop every child (SIGTERM, then SIGKILL after a grace period) and exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

from pdserve import layout
from pdserve.credentials import ADMIN_KEY_ENV, API_KEY_ENV, TOKEN_ENV, add_secret_args, read_secret
from pdserve.config import parse_size
from pdserve.flags import add_flags, config_argv, flag_argv
from pdserve.layout import Layout
from pdserve.store_server import LocalStore
from pdserve.router.config import RouterConfig
from pdserve.supervisor import RestartPolicy, Supervisor
from pdserve.worker.config import WorkerConfig

STOP_GRACE_S = 15.0
CHECK_EVERY_S = 0.1  # how often the children are looked at: exits, restarts due, ready lines


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--prefill", type=int, default=None,
                   help="prefill workers (given alone: a disaggregated cluster with 1 decode worker)")
    g.add_argument("--decode", type=int, default=None,
                   help="decode workers (given alone: a disaggregated cluster with 1 prefill worker)")
    g.add_argument("--colocated", type=int, default=None,
                   help="colocated (both) workers. With none of the three: the layout that serves this host best "
                        "(one colocated worker below 8 cores, else 1P1D), said at start")
    g.add_argument("--transfer", default="shm,tcp")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000, help="the router's port")
    g.add_argument("--routers", type=int, default=1,
                   help="routers serving the cluster on --port together (SO_REUSEPORT): the kernel spreads clients "
                        "among them, every worker registers with each, one of them leads (docs/router.md); a "
                        "router that dies leaves the address served by the others while it restarts; with --ray, "
                        "each on a node of its own where there are nodes enough, also on --port + 1 + its number")
    add_secret_args(g, "api-key", API_KEY_ENV, "the key clients must send as Bearer (none: clients are not asked)")
    add_secret_args(g, "admin-key", ADMIN_KEY_ENV, "the router's admin API key (none: no admin API)")
    add_secret_args(g, "token", TOKEN_ENV, "the cluster's shared worker token (none: a fresh one for this cluster)")
    g.add_argument("--pin-cpus", action="store_true", help="give each worker its own cores")
    g.add_argument("--record-steps", default=None, metavar="DIR",
                   help="each worker logs its steps to DIR/<role>-<n>.jsonl (for `pdserve profile --from-steps`)")
    g.add_argument("--ready-timeout", type=float, default=600.0)
    g.add_argument("--max-restart-backoff", type=float, default=30.0,
                   help="seconds between restarts of a child that keeps exiting (the backoff doubles up to this)")
    g.add_argument("--durable-kv", action="store_true",
                   help="each decode worker keeps its KV pool in a shared-memory file this command holds, with a "
                        "journal: a worker that crashes is restarted and resumes its running requests from their KV, "
                        "and the router resumes their streams (CPU)")
    g.add_argument("--standby", action="store_true",
                   help="each decode (and colocated) worker has a spare process, its model loaded, that takes its "
                        "place at once when it exits (with --durable-kv: its streams resume in well under a second; "
                        "costs the model's memory again)")
    g.add_argument("--local-kv-store", type=parse_size, default=0, metavar="SIZE",
                   help="start a Valkey server of this many bytes (e.g. 4GiB) on a private unix socket as a KV tier "
                        "the workers share (--kv-store): the prefix blocks their pools evict, read back by any of "
                        "them (`pip install pdserve[store]`)")
    g.add_argument("--fault-injection", action="store_true",
                   help="workers serve their fault-injection route (`pdserve worker --fault-injection`): a testing "
                        "aid for `pdserve bench chaos`; off by default")
    for pool in ("prefill", "decode"):
        g.add_argument(f"--{pool}-engine-args", default="", metavar="FLAGS",
                       help=f"engine flags for the {pool} workers alone, after the common ones (they win), e.g. "
                            f"--{pool}-engine-args=\"--tensor-parallel-size 2 --dtype bfloat16\"" + (
                                " or \"--quantization int4\": each pool in its own split and precision"
                                if pool == "decode" else ""))
    add_flags(p, RouterConfig, "router (handed to the cluster's router)")


def pool_engine_argv(args: argparse.Namespace, role: str) -> list[str]:
    """The `--prefill-engine-args` / `--decode-engine-args` of a worker of `role`, checked: engine
    flags only, the model and threads excepted (one model per cluster; the launcher gives threads)."""
    return _pool_flags(args, role)[0]


def pool_tensor_parallel(args: argparse.Namespace, role: str) -> int:
    """The tensor-parallel ranks of a worker of `role`: its pool's engine flags', else the common one."""
    return _pool_flags(args, role)[1].tensor_parallel_size


def _pool_flags(args: argparse.Namespace, role: str) -> tuple[list[str], argparse.Namespace]:
    """(the pool's engine flags as given, the engine flags they make over the common ones)."""
    from pdserve.config import EngineConfig

    text = getattr(args, f"{role}_engine_args", "") if role in ("prefill", "decode") else ""
    argv = shlex.split(text)
    parser = argparse.ArgumentParser(prog=f"--{role}-engine-args", add_help=False, exit_on_error=False)
    add_flags(parser, EngineConfig, "engine")
    try:
        parsed, unknown = parser.parse_known_args(argv, argparse.Namespace(**vars(args)))
    except argparse.ArgumentError as e:
        raise SystemExit(f"pdserve serve: --{role}-engine-args: {e}") from None
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    refused = sorted(unknown) + sorted(given & {"--model", "--threads"})
    if refused:
        raise SystemExit(f"pdserve serve: --{role}-engine-args takes engine flags other than --model and --threads; "
                         f"not {' '.join(refused)}")
    return argv, parsed


def router_argv(args: argparse.Namespace, host: str, port: int) -> list[str]:
    """`pdserve router` as `pdserve serve` (local or on Ray) starts it: its router flags as given."""
    return ["router", *_model(args), "--host", host, "--port", str(port), *flag_argv(RouterConfig, args)]


def worker_argv(args: argparse.Namespace, engine_argv: list[str], role: str, index: int, router_url: str,
                host: str, threads: int, durable_kv: str | None = None) -> list[str]:
    """`pdserve worker` number `index` as `pdserve serve` (local or on Ray) starts it; `durable_kv`:
    the name of the KV pool file it keeps through restarts."""
    steps = str(Path(args.record_steps) / f"{role}-{index}.jsonl") if args.record_steps else None
    settings = WorkerConfig(port=0, router=router_url, transfer=args.transfer, record_steps=steps,
                            fault_injection=args.fault_injection, durable_kv=durable_kv,
                            otlp_traces_endpoint=args.otlp_traces_endpoint)  # the worker makes the steps' folder, on its node
    # the host apart: on Ray it is a placeholder the actor fills in with its node's address
    return ["worker", *_model(args), "--role", role, "--host", host, *config_argv(settings), "--threads", str(threads),
            *engine_argv, *pool_engine_argv(args, role)]


def _model(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model] if args.model else []


def _cpu_shares(num_workers: int) -> list[list[int]]:
    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // num_workers)
    return [cpus[(i * share) % len(cpus):][:share] or cpus[:share] for i in range(num_workers)]


def _threads(args: argparse.Namespace, share: list[int]) -> int:
    """Torch threads of a worker: `--threads` where given, else one per core of its share."""
    return args.threads or len(share)


def serve_layout(args: argparse.Namespace) -> Layout:
    """The flags' layout, or the one chosen for this host (its usable cores, and GPUs with --device cuda)."""
    given = layout.from_flags(args.prefill, args.decode, args.colocated)
    if given is not None:
        return given
    device = str(getattr(args, "device", "cpu") or "cpu")
    gpus = 0
    if device.startswith("cuda"):
        import torch

        gpus = torch.cuda.device_count()
    return layout.choose(len(os.sched_getaffinity(0)), device, gpus)


def run_serve(args: argparse.Namespace, engine_argv: list[str]) -> int:
    chosen = serve_layout(args)
    roles = chosen.roles
    api_key = read_secret(args.api_key_file, API_KEY_ENV)
    token = read_secret(args.token_file, TOKEN_ENV) or secrets.token_hex(32)  # a fresh one unless given
    env = {**os.environ, TOKEN_ENV: token, API_KEY_ENV: api_key,
           ADMIN_KEY_ENV: read_secret(args.admin_key_file, ADMIN_KEY_ENV)}
    say = lambda msg: print(f"[pdserve serve] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    def report(event: dict) -> None:  # a machine-readable line, and a sentence for people
        print(json.dumps(event), flush=True)
        say(describe_event(event))

    sup = Supervisor(env, RestartPolicy(max_backoff_s=args.max_restart_backoff), report)
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    code = 0
    pools: list[str] = []  # durable KV pools this command holds for its decode workers
    store = None  # the local KV store this command holds for its workers
    try:
        if args.local_kv_store:
            store = LocalStore(args.local_kv_store)
            env.update(store.env)  # the password: in the workers' environment, never on a command line
            engine_argv = [*engine_argv, "--kv-store", store.url]
            say(f"KV store: Valkey at {store.url} ({args.local_kv_store >> 20} MiB)")
        t0 = time.perf_counter()
        say(f"layout: {chosen.describe()}")
        url, own = start_routers(sup, args, args.ready_timeout)
        say(f"router{'s' if len(own) > 1 else ''} ready at {url}")
        shares = _cpu_shares(len(roles))
        workers = []
        for i, role in enumerate(roles):
            pool = durable_pool_name() if args.durable_kv and role != "prefill" else None
            pools += [pool] if pool else []
            argv = worker_argv(args, engine_argv, role, i, ",".join(own), args.host, _threads(args, shares[i]), pool)
            workers.append(sup.start(f"{role} worker {i}", argv, shares[i] if args.pin_cpus else None,
                                     standby=args.standby and role != "prefill"))
        for w in workers:
            info = w.child.wait_ready(args.ready_timeout)
            say(f"{w.name} ready at {info['url']} (loaded in {info['load_seconds']}s)")
        for router_url in own:  # each router has every worker
            wait_registered(router_url, len(roles), args.ready_timeout)
        say(f"all {len(roles)} workers registered in {time.perf_counter() - t0:.1f}s")
        model_name = served_model(url, api_key)
        members = [{"name": m.name, "url": m.child.ready["url"], "pid": m.child.proc.pid, "cpus": m.cpus,
                    **({"internal_url": m.child.ready["internal_url"]} if "internal_url" in m.child.ready else {})}
                   for m in sup.members]
        print(json.dumps({"event": "ready", "url": url, "model": model_name, "workers": roles, "layout": chosen.reason,
                          "processes": members}),
              flush=True)
        say(f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d "
            f"'{{\"model\": \"{model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'")
        while not stopping.wait(CHECK_EVERY_S):
            sup.check()
    except RuntimeError as e:
        say(str(e))
        code = 1
    finally:
        say("stopping")
        sup.stop(STOP_GRACE_S)
        remove_durable_pools(pools)
        if store is not None:
            store.stop()
        print(json.dumps({"event": "stopped"}), flush=True)
    return code


def start_routers(sup: Supervisor, args: argparse.Namespace, timeout: float) -> tuple[str, list[str]]:
    """`--routers` routers on one address (the first one's; each restarts on it), each also on a port
    of its own where the workers register and the routers ask each other which leads. Returns the
    clients' URL and each router's own."""
    count = args.routers
    own_ports = [free_port(args.host) for _ in range(count)] if count > 1 else []
    own = [f"http://{args.host}:{p}" for p in own_ports]
    port, url = args.port, ""
    for i in range(count):
        argv = router_argv(args, args.host, port)
        if count > 1:
            argv += ["--reuse-port", "--internal-port", str(own_ports[i]), "--peers", ",".join(own)]
        router = sup.start("router" if count == 1 else f"router {i}", argv)
        url = router.child.wait_ready(timeout)["url"]
        port = int(url.rsplit(":", 1)[1])
        _set_flag(router.argv, "--port", str(port))  # a restarted router takes the same address
    return url, own or [url]


def free_port(host: str) -> int:
    """A port of `host` free now (a router's own, fixed for its restarts)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def durable_pool_name() -> str:
    """A durable KV pool's file name, after this process: a pool whose holder is gone is reaped."""
    return f"pdserve-kv-{os.getpid()}-{secrets.token_hex(8)}"


def remove_durable_pools(names: list[str]) -> None:
    if not names:
        return
    from pdserve.engine.durable_kv import journal_path
    from pdserve.kv_transfer.shm import SHM_DIR

    for name in names:
        path = os.path.join(SHM_DIR, name)
        for file in (path, journal_path(path), journal_path(path) + ".tmp"):
            try:
                os.unlink(file)
            except FileNotFoundError:
                pass


def describe_event(event: dict) -> str:
    kind, name = event["event"], event["name"]
    if kind == "exited":
        return f"{name} exited with code {event['code']}; starting it again in {event['restart_in_s']}s"
    if kind == "restarted":
        how = ": its standby took its place" if event.get("standby") else ""
        return f"{name} started again (restart {event['restarts']}, pid {event['pid']}){how}"
    if kind == "standby":
        return f"{name} has a standby, loaded in {event['load_seconds']}s (pid {event['pid']})"
    if kind == "ready_again":
        loaded = f" (loaded in {event['load_seconds']}s)" if event.get("load_seconds") is not None else ""
        return f"{name} ready again at {event['url']}{loaded}"
    return (f"{name} is crash-looping: {event['exits']} exits within {event['window_s']:.0f}s; "
            f"starting it again every {event['restart_every_s']:.0f}s until it stays up")


def _set_flag(argv: list[str], flag: str, value: str) -> None:
    argv[argv.index(flag) + 1] = value


def served_model(router_url: str, api_key: str) -> str:
    """The model's name as the router serves it (its /v1/models)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(router_url + "/v1/models", headers=headers).json()["data"][0]["id"]


def wait_registered(url: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/health").json().get("workers", 0) < count:
        if time.monotonic() > deadline:
            raise RuntimeError("the workers did not register with the router in time")
        time.sleep(0.1)
