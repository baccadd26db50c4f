"""Listening sockets for the HTTP servers, and the one way to build a server on them."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # uvicorn loads with the server, not with the command line
    import uvicorn
    from starlette.types import ASGIApp


def tcp_listener(host: str, port: int, backlog: int = 2048, dead_peer_s: float = 30.0,
                 reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket whose protocol is spelled out: asyncio turns Nagle's algorithm off only
    for sockets that say IPPROTO_TCP, and with it on, every response on a kept-alive connection
    waited ~40 ms for the client's delayed ACK (`socket.create_server` leaves the protocol 0).

    Connections it accepts inherit dead-peer detection: a peer that vanished without closing
    (a crashed host, a cut link) is declared gone after about `dead_peer_s` of unacknowledged
    data or silence, so the stream it held ends, the worker aborts the request and its KV is
    reclaimed, instead of waiting for TCP's default of many minutes. `reuse_port`: several
    processes listen on the address at once (each with it), the kernel spreading connections
    among them; one that dies leaves the address served by the others."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    detect_dead_peers(sock, dead_peer_s)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def detect_dead_peers(sock: socket.socket, timeout_s: float) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(timeout_s / 2))
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", max(1, idle // 3)), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", int(timeout_s * 1000))):
        option = getattr(socket, name, None)
        if option is not None:  # Linux has them all; elsewhere keep-alive with the system's timing
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one listener grants its clients, whoever they are."""

    max_concurrency: int = 2048  # open connections, or requests in flight; past it a request gets 503
    keep_alive_s: float = 5.0  # an idle kept-alive connection is closed after this
    head_timeout_s: float = 10.0  # a connection serving no request must send a whole request head within this
    max_head_bytes: int = 32 << 10  # a request head still incomplete past this many bytes gets 400

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.keep_alive_s <= 0 or self.head_timeout_s <= 0:
            raise ValueError(f"keep_alive_s and head_timeout_s must be > 0, got {self.keep_alive_s} and "
                             f"{self.head_timeout_s}")
        if self.max_head_bytes < 1024:
            raise ValueError(f"max_head_bytes must be >= 1024, got {self.max_head_bytes}")


ROUTER_LIMITS = ServerLimits()
# A worker serves the router's streams (at most the router's own limit) plus its peers' calls
# (prefill leases, aborts, KV info, stats).
WORKER_LIMITS = ServerLimits(max_concurrency=ROUTER_LIMITS.max_concurrency + 512)


def http_server(app: ASGIApp, limits: ServerLimits, lifespan: str = "auto") -> uvicorn.Server:
    """A uvicorn server for `app` under `limits`; run it with `.run(sockets=[tcp_listener(...)])`."""
    import functools

    import uvicorn

    from pdserve.http_protocol import GuardedH11Protocol

    protocol = functools.partial(GuardedH11Protocol, head_timeout_s=limits.head_timeout_s)
    # no WebSocket routes: an upgrade would hand the connection to a protocol with no head deadline
    return uvicorn.Server(uvicorn.Config(
        app, http=protocol, ws="none", lifespan=lifespan, log_level="warning", limit_concurrency=limits.max_concurrency,
        timeout_keep_alive=limits.keep_alive_s, h11_max_incomplete_event_size=limits.max_head_bytes,
    ))
