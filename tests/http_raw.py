"""HTTP/1.1 by hand, for requests no well-behaved client sends: lying headers, slow bytes."""

from __future__ import annotations

import http.client
import select
import socket
import time
from urllib.parse import urlsplit


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=30)


def head(method: str, path: str, *headers: str) -> bytes:
    return "\r\n".join([f"{method} {path} HTTP/1.1", "Host: test", *headers, "", ""]).encode()


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    r = http.client.HTTPResponse(sock)
    r.begin()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed the connection (nothing more to read)."""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def trickle(sock: socket.socket, data: bytes, pause_s: float) -> int:
    """Sends `data` a byte every `pause_s` until the server answers or closes; how many it sent."""
    for sent in range(len(data)):
        if select.select([sock], [], [], 0)[0]:
            return sent
        try:
            sock.sendall(data[sent:sent + 1])
        except (BrokenPipeError, ConnectionResetError):
            return sent
        time.sleep(pause_s)
    return len(data)
