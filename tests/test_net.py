"""The HTTP listeners: Nagle off on accepted connections, and dead-peer detection inherited."""

import socket

import pytest

from pdserve.net import tcp_listener


def test_accepted_connections_detect_dead_peers():
    listener = tcp_listener("127.0.0.1", 0, dead_peer_s=12)
    client = socket.create_connection(listener.getsockname())
    conn, _ = listener.accept()
    try:
        assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 12_000
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 6
        assert listener.proto == socket.IPPROTO_TCP
    finally:
        for s in (conn, client, listener):
            s.close()


def test_a_taken_port_is_a_clear_error():
    first = tcp_listener("127.0.0.1", 0)
    try:
        with pytest.raises(OSError):
            tcp_listener("127.0.0.1", first.getsockname()[1])
    finally:
        first.close()
