"""`pdserve worker`: one worker process, serving its control endpoint until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import socket
import sys
import time

from pdserve.config import ROLES, EngineConfig
from pdserve.credentials import TOKEN_ENV, add_secret_args, is_loopback, new_token_file, read_secret
from pdserve.flags import add_flags, flag_kwargs
from pdserve.net import WORKER_LIMITS, http_server, tcp_listener
from pdserve.worker.config import WorkerConfig


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=ROLES, default="both")
    p.add_argument("--standby", action="store_true",
                   help="load the model, then wait for a line 'go' on stdin before serving (a supervisor's spare)")
    add_flags(p, WorkerConfig, "worker")
    add_secret_args(p, "token", TOKEN_ENV, "the cluster's shared secret for the control endpoint and KV connections "
                    "(none: one is made and written to a file, on a loopback address without --router only)")


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The worker's settings from its parsed flags (ValueError for a value no flag type catches)."""
    return WorkerConfig(**flag_kwargs(WorkerConfig, args))


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
    settings = worker_config(args)
    if not set(settings.backends) <= set(PRODUCTION_BACKENDS):  # `memory` reaches nothing outside its own process
        raise ValueError(f"--transfer takes a list of {', '.join(PRODUCTION_BACKENDS)}; got {args.transfer!r}")
    token, token_file = worker_token(args)
    config = EngineConfig(model=resolve_model(args.model), role=args.role, **engine_kwargs)
    if args.standby:
        from pdserve.worker.standby import stand_by

        if not stand_by(config):
            return 0
        t0 = time.perf_counter()  # its load: from standing in
    worker = Worker(config, settings, token, name=f"{args.role}@{socket.gethostname()}")
    compiled = worker.engine.runner.compiled
    if compiled is not None:  # ready means at full speed: no compile competes with requests for the cores
        logging.getLogger("pdserve.worker").info("compiling the decode graphs before taking requests")
        compiled.warm_up()
    # the first structured output would otherwise wait for this
    logging.getLogger("pdserve.worker").info("structured outputs ready in %.2f s",
                                             worker.engine.structures.grammars.prepare())
    # What is loaded by now (the model, torch, the libraries: ~300k objects) lives as long as the
    # process: kept out of the collector's full passes, each of which would otherwise hold the GIL,
    # and so the engine's thread, for ~100 ms (2-vCPU Xeon).
    gc.freeze()
    worker.start()
    sock = tcp_listener(settings.host, settings.port)
    url = worker_url(settings.advertised_host, sock.getsockname()[1])
    ready = {"event": "ready", "url": url, "role": args.role, "kv": worker.offers,
             "load_seconds": round(time.perf_counter() - t0, 2), "pid": os.getpid(),
             **({"token_file": token_file} if token_file else {})}
    print(json.dumps(ready), flush=True)
    if settings.router:
        worker.join(settings.router, url)
    server = http_server(create_app(worker, token, fault_injection=settings.fault_injection), WORKER_LIMITS)
    drain = Drain(worker, server, settings.drain_timeout)
    server.handle_exit = drain.handle_signal
    worker.on_drain_request(drain.begin)
    # uvicorn re-raises a signal it stopped on: let that land here, so the worker still stops
    # cleanly (connections closed, shared KV pool removed) and exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        worker.stop()
        print(json.dumps({"event": "stopped", "url": url}), file=sys.stderr, flush=True)
    return 0
