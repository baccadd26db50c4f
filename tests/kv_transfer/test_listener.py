"""The decode worker's KV port: a cap on connections, and an accept loop that only `close()` ends."""

from __future__ import annotations

import errno
import socket

import pytest

from pdserve.kv_transfer.listener import Listener, PeerLimits
from tests.kv_transfer.raw_peer import closed_by_peer, connect, make_receiver
from tests.wait import wait_for

QUICK = PeerLimits(accept_backoff_s=0.01)


def greet(sock: socket.socket, accepted_at: float) -> None:
    with sock:
        sock.sendall(b"hi")


def served(listener: Listener) -> bool:
    with socket.create_connection(listener.address, timeout=10) as sock:
        return sock.recv(2) == b"hi"


def test_connections_past_the_cap_are_closed_at_once_and_counted():
    rx = make_receiver(peers=PeerLimits(max_connections=2))
    try:
        first, second = connect(rx), connect(rx)
        extra = connect(rx, say_hello=False)
        assert closed_by_peer(extra)
        assert rx.num_refused_connections == 1 and rx.num_connections == 2
        first.close()
        wait_for(lambda: rx.num_connections == 1, 10, "the connection accepted")
        third = connect(rx)  # a freed place is taken again
        assert rx.num_refused_connections == 1
        for sock in (second, third, extra):
            sock.close()
    finally:
        rx.close()


class FlakyAccept(Listener):
    """Accepts that fail the way a process out of descriptors, or a reset peer, makes them fail."""

    def __init__(self, *args, failures: list[int]) -> None:
        self.failures = failures
        super().__init__(*args)

    def _accept(self) -> socket.socket:
        if self.failures:
            code = self.failures.pop(0)
            raise OSError(code, errno.errorcode[code])
        return super()._accept()


def test_failed_accepts_do_not_end_the_loop():
    listener = FlakyAccept("127.0.0.1", 0, greet, QUICK, failures=[errno.EMFILE, errno.ENFILE, errno.ECONNABORTED])
    try:
        assert served(listener) and served(listener)
        assert listener.num_failed_accepts == 3
    finally:
        listener.close()


class NoThreads(Listener):
    """The first reader thread will not start (the process is at its thread limit)."""

    def __init__(self, *args) -> None:
        self.refusals = 1
        super().__init__(*args)

    def _spawn(self, sock: socket.socket, accepted_at: float) -> None:
        if self.refusals:
            self.refusals -= 1
            raise RuntimeError("can't start new thread")
        super()._spawn(sock, accepted_at)


def test_a_thread_that_will_not_start_drops_only_its_connection():
    listener = NoThreads("127.0.0.1", 0, greet, QUICK)
    try:
        with socket.create_connection(listener.address, timeout=10) as unlucky:
            assert closed_by_peer(unlucky)
        assert served(listener)
        assert listener.num_failed_accepts == 1
        wait_for(lambda: listener.num_connections == 0, 10, "no connection held")  # the failed one holds no place
    finally:
        listener.close()


def test_close_ends_the_accept_loop():
    listener = Listener("127.0.0.1", 0, greet, QUICK)
    assert served(listener)
    listener.close()
    listener.thread.join(10)
    assert not listener.thread.is_alive()
    with pytest.raises(OSError):
        served(listener)


@pytest.mark.parametrize("field, value", [("max_connections", 0), ("hello_timeout_s", 0), ("release_grace_s", -1)])
def test_limits_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        PeerLimits(**{field: value})
