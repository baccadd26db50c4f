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
from pdserve.router.rebalance import RebalancePolicy


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0.0 < value < 86400.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 86400) seconds, got {text}")
    return value


def _milliseconds(text: str) -> float:
    value = float(text)
    if not 0.0 < value < 86_400_000.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 86400000) milliseconds, got {text}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 1 << 20:
        raise argparse.ArgumentTypeError(f"must be in [1, {1 << 20}], got {text}")
    return value


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the model the workers serve (for its tokenizer and limits)")
    p.add_argument("--served-model-name", default=None, help="the name clients ask for (default: the model's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_secret_args(p, "api-key", API_KEY_ENV, "the key clients must send as Bearer (none: clients are not asked)")
    add_secret_args(p, "admin-key", ADMIN_KEY_ENV, "the admin API's Bearer key (none: no admin API)")
    add_secret_args(p, "token", TOKEN_ENV, "the workers' shared secret (none: one is made and written to a file, "
                    "on a loopback address only)")
    p.add_argument("--max-tokens-default", type=int, default=1024,
                   help="max_tokens of a chat request that sets none (within the context the prompt leaves)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--lease", type=float, default=10.0, help="seconds a worker stays registered without a heartbeat")
    p.add_argument("--max-queued-requests", type=_count, default=1024,
                   help="requests the router holds at once; past it clients get 429")
    p.add_argument("--queue-timeout", type=_seconds, default=300.0,
                   help="seconds an admitted request waits for a worker with room in its queue before a 503")
    p.add_argument("--migrate-on-failure", action="store_true",
                   help="a decode worker lost mid-stream: continue on another by recomputing prompt + output")
    p.add_argument("--hot-kv-usage", type=_fraction, default=0.85,
                   help="KV use past which a decode worker gets no new work and running requests move off it")
    p.add_argument("--no-hot-spot-migration", action="store_true",
                   help="keep running requests where they are, however hot their decode worker")
    add_controller_args(p)


_POLICY = RebalancePolicy()


def add_controller_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The targets and the P:D controller's flags; `pdserve serve` takes the same ones and hands them
    to its router (`controller_argv`)."""
    p.add_argument("--rebalance", action="store_true",
                   help="the P:D controller: move workers between the prefill and decode pools as their pressure "
                        "against the TTFT and TPOT targets says (off by default)")
    p.add_argument("--rebalance-confirm-s", type=_seconds, default=_POLICY.confirm_s,
                   help="seconds a pool's need must hold before the controller moves a worker")
    p.add_argument("--rebalance-dwell-s", type=_seconds, default=_POLICY.dwell_s,
                   help="seconds after a move before the controller considers another")
    p.add_argument("--slo-ttft-ms", type=_milliseconds, default=_POLICY.ttft_target_s * 1e3,
                   help="TTFT target: SLA attainment metrics, and the controller's prefill pressure")
    p.add_argument("--slo-tpot-ms", type=_milliseconds, default=_POLICY.tpot_target_s * 1e3,
                   help="TPOT target: SLA attainment metrics, and the controller's decode pressure")


def controller_argv(args: argparse.Namespace) -> list[str]:
    """The flags of `add_controller_args` as parsed, as argv for a `pdserve router`."""
    return [*(["--rebalance"] if args.rebalance else []),
            "--rebalance-confirm-s", repr(args.rebalance_confirm_s), "--rebalance-dwell-s", repr(args.rebalance_dwell_s),
            "--slo-ttft-ms", repr(args.slo_ttft_ms), "--slo-tpot-ms", repr(args.slo_tpot_ms)]


def rebalance_policy(args: argparse.Namespace) -> RebalancePolicy | None:
    """The controller's policy from parsed args; None without --rebalance."""
    if not args.rebalance:
        return None
    return RebalancePolicy(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3, args.hot_kv_usage,
                           confirm_s=args.rebalance_confirm_s, dwell_s=args.rebalance_dwell_s)


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
    from pdserve.router.config import RouterConfig
    from pdserve.router.router import Router
    from pdserve.router.policy import DecodeWeights
    path = resolve_model(args.model)
    info = load_model_info(path)  # no tensors: the router computes nothing with the model
    arch = ArchConfig.from_hf_config(info.hf_config)
    limit = arch.max_position_embeddings if not arch.sliding_window else min(arch.max_position_embeddings, arch.sliding_window)
    name = args.served_model_name or (args.model or "default")
    config = RouterConfig(model_name=name, max_model_len=min(args.max_model_len or limit, limit), api_key=api_key,
                          admin_key=read_secret(args.admin_key_file, ADMIN_KEY_ENV),
                          worker_token=token, max_tokens_default=args.max_tokens_default, lease_s=args.lease, max_queued_requests=args.max_queued_requests,
                          queue_timeout_s=args.queue_timeout,
                          ttft_slo_s=args.slo_ttft_ms / 1e3, tpot_slo_s=args.slo_tpot_ms / 1e3,
                          migrate_on_failure=args.migrate_on_failure, migrate_hot_spots=not args.no_hot_spot_migration,
                          decode_weights=DecodeWeights(hot_kv_usage=args.hot_kv_usage),
                          rebalance=rebalance_policy(args))
    return Router(config, info.tokenizer, model_fingerprint(arch), arch.vocab_size)


def run_router(args: argparse.Namespace) -> int:
    from pdserve.net import ROUTER_LIMITS, http_server, tcp_listener

    from pdserve.router.app import create_app

    # the router's own decisions (workers joining and leaving, the P:D controller's moves and their
    # reasons) are INFO lines; without a handler only warnings would reach stderr
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per call to a worker
    api_key, token, token_file = router_secrets(args)
    router = build_router(args, api_key, token)
    sock = tcp_listener(args.host, args.port)
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    ready = {"event": "ready", "url": url, "model": router.config.model_name, "pid": os.getpid()}
    print(json.dumps({**ready, **({"token_file": token_file} if token_file else {})}), flush=True)
    server = http_server(create_app(router), ROUTER_LIMITS)
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises them after draining
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    print(json.dumps({"event": "stopped", "url": url}), file=sys.stderr, flush=True)
    return 0
