"""The decode worker's KV port: accepts prefill peers, each served on a thread of its own.

What a peer is granted is bounded (`PeerLimits`): a number of connections at once (one past it is
closed at accept and counted), a deadline for the handshake, dead-peer detection (TCP keep-alive
and a user timeout, so a host that vanished mid-transfer frees its leases in seconds rather than
the kernel's ~15 minutes), and a grace period for acknowledging aborted leases.

Only `close()` ends the accept loop: a failed accept (out of file descriptors, a connection reset
before it was taken) or a reader thread that would not start drops that one connection, is
logged, and the loop goes on after a pause, which gives descriptors time to come back (doubling
while failures follow each other, up to `MAX_ACCEPT_BACKOFF_S`, so the log is not flooded).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from pdserve.net import detect_dead_peers

log = logging.getLogger("pdserve.kv_transfer")

MAX_ACCEPT_BACKOFF_S = 2.0


@dataclass(frozen=True, slots=True)
class PeerLimits:
    """What the KV listener grants its prefill peers, whoever they are."""

    max_connections: int = 64  # open at once; pooled senders need one per prefill worker and backend
    hello_timeout_s: float = 10.0  # from accept to a complete HELLO frame
    dead_peer_s: float = 30.0  # a peer that neither acknowledges data nor answers keep-alives is gone
    release_grace_s: float = 10.0  # for an in-place writer to acknowledge an abort before it is cut off
    accept_backoff_s: float = 0.1  # pause after the first of a run of failed accepts

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if not min(self.hello_timeout_s, self.dead_peer_s, self.release_grace_s) > 0:
            raise ValueError(f"hello_timeout_s, dead_peer_s and release_grace_s must be > 0, got "
                             f"{self.hello_timeout_s}, {self.dead_peer_s} and {self.release_grace_s}")
        if not 0 < self.accept_backoff_s <= MAX_ACCEPT_BACKOFF_S:
            raise ValueError(f"accept_backoff_s must be in (0, {MAX_ACCEPT_BACKOFF_S}], got {self.accept_backoff_s}")


# Serves one accepted connection until it ends, on its own thread; given the monotonic time of the
# accept. The socket is the callee's to close.
Serve = Callable[[socket.socket, float], None]


class Listener:
    def __init__(self, host: str, port: int, serve: Serve, limits: PeerLimits) -> None:
        self.limits = limits
        self._serve = serve
        self._sock = socket.create_server((host, port))
        self.address = self._sock.getsockname()[:2]
        self._lock = threading.Lock()
        self._active = 0  # connections being served
        self._closing = False
        self._backoff_s = limits.accept_backoff_s
        self.num_refused_connections = 0  # closed at accept: the cap was reached
        self.num_failed_accepts = 0  # accepts, socket setups or thread starts that failed
        self.thread = threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True)
        self.thread.start()

    @property
    def num_connections(self) -> int:
        with self._lock:
            return self._active

    def close(self) -> None:
        self._closing = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept(); closing alone does not on Linux
        except OSError:
            pass
        self._sock.close()

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                sock = self._accept()
            except OSError as e:
                if self._closing:
                    return
                self._failed(None, f"accept failed: {e}")
                continue
            if self._admit(sock):
                self._backoff_s = self.limits.accept_backoff_s

    def _admit(self, sock: socket.socket) -> bool:
        """Serve the connection, or close it; False if that failed."""
        accepted_at = time.monotonic()
        with self._lock:
            full = self._active >= self.limits.max_connections
            if not full:
                self._active += 1
        if full:
            self.num_refused_connections += 1
            sock.close()
            return True
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # acks and aborts are small
            detect_dead_peers(sock, self.limits.dead_peer_s)
            self._spawn(sock, accepted_at)
            return True
        except Exception as e:  # RuntimeError: no thread could be started; OSError: the peer is gone
            with self._lock:
                self._active -= 1
            self._failed(sock, f"cannot serve a new connection: {e}")
            return False

    def _failed(self, sock: socket.socket | None, message: str) -> None:
        self.num_failed_accepts += 1
        if sock is not None:
            sock.close()
        log.warning("KV listener on %s:%s: %s; going on in %.2fs", *self.address, message, self._backoff_s)
        time.sleep(self._backoff_s)
        self._backoff_s = min(2 * self._backoff_s, MAX_ACCEPT_BACKOFF_S)

    # The two steps that touch the system, apart so that tests can make them fail.

    def _accept(self) -> socket.socket:
        return self._sock.accept()[0]

    def _spawn(self, sock: socket.socket, accepted_at: float) -> None:
        threading.Thread(target=self._run, args=(sock, accepted_at), name="kv-recv", daemon=True).start()

    def _run(self, sock: socket.socket, accepted_at: float) -> None:
        try:
            self._serve(sock, accepted_at)
        finally:
            with self._lock:
                self._active -= 1
