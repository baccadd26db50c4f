"""`pdserve worker`: one worker process, serving its control endpoint until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import signal
import socket
import sys
import time

from pdserve.config import EngineConfig
from pdserve.credentials import TOKEN_ENV, add_secret_args, is_loopback, new_token_file, read_secret
from pdserve.net import WORKER_LIMITS, http_server, tcp_listener
from pdserve.wire import NODE_NAME


def _host(text: str) -> str:
    """A host name or an IPv4/IPv6 address, as it goes into a URL: nothing that could add a path,
    a user or a port."""
    if not text or len(text) > 253 or not all(c.isalnum() or c in ".-:" for c in text):
        raise argparse.ArgumentTypeError(f"expected a host name or an IP address, got {text!r}")
    return text


def _node_name(text: str) -> str:
    if not re.fullmatch(NODE_NAME, text):
        raise argparse.ArgumentTypeError(f"expected up to 128 letters, digits and _.:@-, got {text!r}")
    return text


def _this_host() -> str:
    """The host name as a node name: any character a node name cannot hold becomes '-'."""
    return re.sub(r"[^A-Za-z0-9_.:@\-]", "-", socket.gethostname())[:128]


def add_worker_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker")
    g.add_argument("--role", choices=["prefill", "decode", "both"], default="both")
    g.add_argument("--host", default="127.0.0.1", help="address of the control endpoint and KV port")
    g.add_argument("--advertise-host", default=None, metavar="HOST", type=_host,
                   help="address the router and peers are told to reach this worker at (default: --host); with "
                        "--host 0.0.0.0 in Kubernetes, the pod's IP (the downward API's status.podIP)")
    g.add_argument("--node-name", default=_this_host(), metavar="NAME", type=_node_name,
                   help="the machine this worker runs on, as the router's /admin/workers shows it (default: the "
                        "host name; on Ray, the Ray node)")
    g.add_argument("--port", type=int, default=8100, help="control endpoint port (0: any free one)")
    g.add_argument("--kv-port", type=int, default=0, help="decode: KV transfer port (0: any free one)")
    g.add_argument("--transfer", default="shm,tcp",
                   help="KV transfer backends in order of preference: nixl, tcp, shm (comma-separated)")
    g.add_argument("--kv-transfer-dtype", choices=["auto", "int8", "fp8"], default="auto",
                   help="decode: ask prefill workers to send KV quantized (tcp, nixl)")
    g.add_argument("--kv-lease-timeout", type=float, default=30.0,
                   help="decode: seconds to wait for a prompt's KV before computing it here")
    g.add_argument("--max-queued", type=int, default=256,
                   help="sequences waiting beyond a full batch (--max-num-seqs) before new requests are refused (503)")
    g.add_argument("--record-steps", default=None, metavar="PATH",
                   help="append every engine step's shape and time to this JSONL file (for `pdserve profile "
                        "--from-steps`)")
    g.add_argument("--router", default=None, help="register with this router and renew the lease by heartbeat")
    g.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds a worker sent SIGTERM finishes its requests before it stops anyway")
    g.add_argument("--fault-injection", action="store_true",
                   help="serve POST /v1/faults/cut-kv-links (with the token): a testing aid that closes every KV "
                        "connection of this worker at once; off by default")
    add_secret_args(g, "token", TOKEN_ENV, "the cluster's shared secret for the control endpoint and KV connections "
                    "(none: one is made and written to a file, on a loopback address without --router only)")


def worker_token(args: argparse.Namespace) -> tuple[str, str | None]:
    """(token, file a new one was written to). The control endpoint and KV port never run open."""
    token = read_secret(args.token_file, TOKEN_ENV)
    if token:
        return token, None
    if args.router:
        raise ValueError(f"--router needs the cluster's token (the router's token file): --token-file or {TOKEN_ENV}")
    if not is_loopback(args.host):
        raise ValueError(f"a worker on {args.host} needs the cluster's token given: --token-file or {TOKEN_ENV}")
    token, path = new_token_file(f"worker-{os.getpid()}")
    print(f"pdserve worker: token written to {path}", file=sys.stderr)
    return token, str(path)


def worker_url(host: str, port: int) -> str:
    """The control endpoint's URL as the router and peers are told it (an IPv6 address bracketed)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_worker(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from pdserve.kv_transfer.registry import PRODUCTION_BACKENDS
    from pdserve.models.registry import resolve_model
    from pdserve.worker.drain import Drain
    from pdserve.worker.server import create_app
    from pdserve.worker.worker import Worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request to a prefill worker
    t0 = time.perf_counter()
    transfer = [t.strip() for t in args.transfer.split(",") if t.strip()]
    if not set(transfer) <= set(PRODUCTION_BACKENDS):  # `memory` reaches nothing outside its own process
        raise ValueError(f"--transfer takes a list of {', '.join(PRODUCTION_BACKENDS)}; got {args.transfer!r}")
    token, token_file = worker_token(args)
    config = EngineConfig(model=resolve_model(args.model), role=args.role, **engine_kwargs)
    advertised = args.advertise_host or args.host
    worker = Worker(
        config, transfer, token, args.host, args.kv_port,
        args.kv_lease_timeout, args.kv_transfer_dtype, args.max_queued, name=f"{args.role}@{socket.gethostname()}",
        record_steps=args.record_steps, advertise_host=advertised,
    )
    compiled = worker.engine.runner.compiled
    if compiled is not None:  # ready means at full speed: no compile competes with requests for the cores
        logging.getLogger("pdserve.worker").info("compiling the decode graphs before taking requests")
        compiled.warm_up()
    # What is loaded by now (the model, torch, the libraries: ~300k objects) lives as long as the
    # process: kept out of the collector's full passes, each of which would otherwise hold the GIL,
    # and so the engine's thread, for ~100 ms (2-vCPU Xeon).
    gc.freeze()
    worker.start()
    sock = tcp_listener(args.host, args.port)
    url = worker_url(advertised, sock.getsockname()[1])
    ready = {"event": "ready", "url": url, "role": args.role, "kv": worker.offers,
             "load_seconds": round(time.perf_counter() - t0, 2), "pid": os.getpid(),
             **({"token_file": token_file} if token_file else {})}
    print(json.dumps(ready), flush=True)
    membership = None
    if args.router:
        from pdserve.worker.registration import RouterMembership
        membership = RouterMembership(args.router, url, args.role, worker.layout.model_hash, worker.stats,
                                      token, worker.config.block_size, args.node_name).start()
        worker.membership = membership
    server = http_server(create_app(worker, token, fault_injection=args.fault_injection), WORKER_LIMITS)
    drain = Drain(worker, server, args.drain_timeout)
    server.handle_exit, worker.begin_drain = drain.handle_signal, drain.begin
    # uvicorn re-raises a signal it stopped on: let that land here, so the worker still stops
    # cleanly (connections closed, shared KV pool removed) and exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        if membership is not None:
            membership.stop()
        worker.stop()
        print(json.dumps({"event": "stopped", "url": url}), file=sys.stderr, flush=True)
    return 0
