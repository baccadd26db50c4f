"""Listening sockets for the HTTP servers."""

from __future__ import annotations

import socket


def tcp_listener(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket whose protocol is spelled out: asyncio turns Nagle's algorithm off only
    for sockets that say IPPROTO_TCP, and with it on, every response on a kept-alive connection
    waited ~40 ms for the client's delayed ACK (`socket.create_server` leaves the protocol 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock
