"""Listening sockets for the HTTP servers."""

from __future__ import annotations

import socket


def tcp_listener(host: str, port: int, backlog: int = 2048, dead_peer_s: float = 30.0) -> socket.socket:
    """A listening TCP socket whose protocol is spelled out: asyncio turns Nagle's algorithm off only
    for sockets that say IPPROTO_TCP, and with it on, every response on a kept-alive connection
    waited ~40 ms for the client's delayed ACK (`socket.create_server` leaves the protocol 0).

    Connections it accepts inherit dead-peer detection: a peer that vanished without closing
    (a crashed host, a cut link) is declared gone after about `dead_peer_s` of unacknowledged
    data or silence, so the stream it held ends, the worker aborts the request and its KV is
    reclaimed, instead of waiting for TCP's default of many minutes."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    _detect_dead_peers(sock, dead_peer_s)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def _detect_dead_peers(sock: socket.socket, timeout_s: float) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(timeout_s / 2))
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", max(1, idle // 3)), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", int(timeout_s * 1000))):
        option = getattr(socket, name, None)
        if option is not None:  # Linux has them all; elsewhere keep-alive with the system's timing
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
