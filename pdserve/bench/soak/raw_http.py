"""HTTP/1.1 by hand, for what no well-behaved client sends: lying headers, slow bytes, a reader
that never reads. Blocking sockets with timeouts; the caller owns and closes them."""

from __future__ import annotations

import http.client
import io
import json
import selectors
import socket
import time
from urllib.parse import urlsplit


def connect(url: str, timeout_s: float, rcvbuf: int | None = None) -> socket.socket:
    """A connection to the server at `url`; `rcvbuf` shrinks the receive buffer before connecting
    (afterwards the window is already advertised)."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(timeout_s)
    try:
        sock.connect((parts.hostname, parts.port))
    except OSError:
        sock.close()
        raise
    return sock


def head(path: str, *headers: str, method: str = "POST") -> bytes:
    return "\r\n".join([f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *headers, "", ""]).encode()


def json_request(path: str, body: bytes, api_key: str, *extra: str) -> bytes:
    """A whole request with a JSON body of `body` (bytes as given, even if not JSON)."""
    return head(path, "Content-Type: application/json", f"Authorization: Bearer {api_key}",
                f"Content-Length: {len(body)}", *extra) + body


def chunked(body: bytes, piece: int) -> bytes:
    """`body` in Transfer-Encoding: chunked framing, `piece` bytes a chunk."""
    parts = [b"%x\r\n%s\r\n" % (len(body[i:i + piece]), body[i:i + piece]) for i in range(0, len(body), piece)]
    return b"".join(parts) + b"0\r\n\r\n"


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The next response on the connection: (status, headers in lower case, body)."""
    r = http.client.HTTPResponse(sock)
    r.begin()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()


def readable(sock: socket.socket, wait_s: float) -> bool:
    """True once `sock` has something to read (or was closed) within `wait_s`. A selector, not
    `select.select`: a burst holds over a thousand sockets, and select() fails past fd 1023."""
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ)
        return bool(sel.select(max(0.0, wait_s)))


def closed_by_server(sock: socket.socket, wait_s: float) -> bool:
    """True if the server closes the connection within `wait_s` (whatever it sent first is read
    and dropped); False if it is still open then."""
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        if not readable(sock, left):
            return False
        try:
            if sock.recv(65536) == b"":
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
    return False


def trickle(sock: socket.socket, data: bytes, pause_s: float, deadline: float) -> tuple[int, bool]:
    """Sends `data` a byte every `pause_s` until the server answers or closes, or `deadline`
    (monotonic) passes; (bytes sent, whether the server spoke or closed first)."""
    for sent in range(len(data)):
        if readable(sock, 0):
            return sent, True
        if time.monotonic() > deadline:
            return sent, False
        try:
            sock.sendall(data[sent:sent + 1])
        except (BrokenPipeError, ConnectionResetError):
            return sent, True
        time.sleep(pause_s)
    return len(data), False


def drain(sock: socket.socket, wait_s: float, limit: int = 64 << 20) -> tuple[bytes, bool]:
    """What the server has sent, read for at most `wait_s`: (bytes, whether it then closed)."""
    deadline = time.monotonic() + wait_s
    got = bytearray()
    while (left := deadline - time.monotonic()) > 0 and len(got) < limit:
        if not readable(sock, left):
            break
        try:
            chunk = sock.recv(1 << 16)
        except (ConnectionResetError, BrokenPipeError):
            return bytes(got), True
        if not chunk:
            return bytes(got), True
        got += chunk
    return bytes(got), False


def status_of(raw: bytes) -> int | None:
    """The status code of a response that starts `raw`, if its whole status line is there."""
    if b"\r\n" not in raw:
        return None
    line = raw.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) >= 2 and line[0].startswith(b"HTTP/") and line[1].isdigit() else None


def dumps(payload: dict) -> bytes:
    return json.dumps(payload).encode()


class _Recorded:
    """Bytes already read, in the shape `http.client.HTTPResponse` reads a socket."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def makefile(self, mode: str) -> io.BytesIO:
        return io.BytesIO(self.data)


def parse_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    """A response already read whole or in part: (status, headers in lower case, as much body as came)."""
    r = http.client.HTTPResponse(_Recorded(data))  # type: ignore[arg-type]
    r.begin()
    try:
        body = r.read()
    except http.client.IncompleteRead as e:
        body = e.partial
    return r.status, {k.lower(): v for k, v in r.getheaders()}, body
