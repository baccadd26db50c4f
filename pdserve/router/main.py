"""`pdserve router`: the OpenAI-compatible front door, until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from pdserve.credentials import (
    ADMIN_KEY_ENV, API_KEY_ENV, TOKEN_ENV, add_secret_args, is_loopback, new_token_file, read_secret,
)
from pdserve.flags import add_flags, flag_kwargs, host_name
from pdserve.router.config import RouterConfig
from pdserve.router_addresses import check as check_addresses


def peers_spec(text: str) -> str:
    if text.strip():
        check_addresses(text)
    return text


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the model the workers serve (for its tokenizer and limits)")
    p.add_argument("--served-model-name", default=None, help="the name clients ask for (default: the model's)")
    p.add_argument("--max-model-len", type=int, default=None, help="the longest context (default: the model's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    g = p.add_argument_group("replicas (several routers serving one cluster; docs/router.md)")
    g.add_argument("--reuse-port", action="store_true",
                   help="listen on --port beside other routers that do too (SO_REUSEPORT): the kernel spreads "
                        "clients among them, and one that dies leaves the address served")
    g.add_argument("--internal-port", type=int, default=None,
                   help="also listen on this port of --host, this router's own: workers register with every router "
                        "at its own address (`pdserve worker --router URL,URL`), and routers ask each other there")
    g.add_argument("--peers", default="", metavar="URL,URL", type=peers_spec,
                   help="the other routers' own addresses (or dns+http://NAME:PORT: every address NAME resolves "
                        "to, looked up again every 5 s; this router's own among them is left out): the one of them "
                        "all whose address sorts first and answers leads (runs the P:D controller, relief, prefix "
                        "copies, rollout steps)")
    g.add_argument("--advertise-host", default=None, type=host_name,
                   help="the address other routers reach this one at (default: --host); with a wildcard --host "
                        "on Kubernetes, the pod's IP (the downward API's status.podIP)")
    add_secret_args(p, "api-key", API_KEY_ENV, "the key clients must send as Bearer (none: clients are not asked)")
    add_secret_args(p, "admin-key", ADMIN_KEY_ENV, "the admin API's Bearer key (none: no admin API)")
    add_secret_args(p, "token", TOKEN_ENV, "the workers' shared secret (none: one is made and written to a file, "
                    "on a loopback address only)")
    add_flags(p, RouterConfig, "router")


def router_secrets(args: argparse.Namespace) -> tuple[str, str, str | None]:
    """(API key, worker token, file a new token was written to). The internal routes never run open:
    without a token one is made, on a loopback address; any other address needs one given."""
    api_key = read_secret(args.api_key_file, API_KEY_ENV)
    token = read_secret(args.token_file, TOKEN_ENV)
    if not is_loopback(args.host):
        if not token:
            raise ValueError(f"a router on {args.host} needs the workers' token given: --token-file or {TOKEN_ENV}")
        if not api_key:
            print(f"pdserve router: warning: listening on {args.host} with no API key: anyone who reaches it "
                  f"is served (--api-key-file or {API_KEY_ENV})", file=sys.stderr)
    if token:
        return api_key, token, None
    token, path = new_token_file(f"router-{os.getpid()}")
    print(f"pdserve router: workers' token written to {path} (start workers with --token-file {path})",
          file=sys.stderr)
    return api_key, token, str(path)


def build_router(args: argparse.Namespace, api_key: str = "", token: str = ""):
    from pdserve.models.arch_config import ArchConfig, model_fingerprint
    from pdserve.models.describe import load_model_info
    from pdserve.models.registry import resolve_model
    from pdserve.router.router import Router
    path = resolve_model(args.model)
    info = load_model_info(path)  # no tensors: the router computes nothing with the model
    arch = ArchConfig.from_hf_config(info.hf_config)
    limit = arch.max_position_embeddings
    name = args.served_model_name or (args.model or "default")
    config = RouterConfig(model_name=name, max_model_len=min(args.max_model_len or limit, limit), api_key=api_key,
                          admin_key=read_secret(args.admin_key_file, ADMIN_KEY_ENV), worker_token=token,
                          **flag_kwargs(RouterConfig, args))
    return Router(config, info.tokenizer, model_fingerprint(arch), arch.vocab_size)


def run_router(args: argparse.Namespace) -> int:
    from pdserve.net import ROUTER_LIMITS, http_server, tcp_listener

    from pdserve.router.app import create_app
    from pdserve.router.peers import Peers
    from pdserve.router_addresses import expand

    # the router's own decisions (workers joining and leaving, the P:D controller's moves and their
    # reasons) are INFO lines; without a handler only warnings would reach stderr
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per call to a worker
    api_key, token, token_file = router_secrets(args)
    router = build_router(args, api_key, token)
    # the first structured output or forced tool call would otherwise wait for this
    logging.getLogger("pdserve.router").info("structured outputs ready in %.2f s", router.grammars.prepare())
    sockets = [tcp_listener(args.host, args.port, reuse_port=args.reuse_port)]
    url = f"http://{args.host}:{sockets[0].getsockname()[1]}"
    host = args.advertise_host or args.host
    own = f"http://{host}:{sockets[0].getsockname()[1]}"
    if args.internal_port is not None:
        sockets.append(tcp_listener(args.host, args.internal_port))
        own = f"http://{host}:{sockets[1].getsockname()[1]}"
    router.peers = Peers(own, expand(args.peers), spec=args.peers)
    ready = {"event": "ready", "url": url, "internal_url": own, "model": router.config.model_name, "pid": os.getpid()}
    print(json.dumps({**ready, **({"token_file": token_file} if token_file else {})}), flush=True)
    server = http_server(create_app(router), ROUTER_LIMITS)
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises them after draining
        signal.signal(sig, lambda *_: None)
    server.run(sockets=sockets)
    print(json.dumps({"event": "stopped", "url": url}), file=sys.stderr, flush=True)
    return 0
