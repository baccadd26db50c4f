"""Peers of `bench compare`: their names, and their processes found by the port they listen on."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from pdserve.bench.peer import listening_pids, parse_peer, peer_pids, with_descendants


def test_peer_names():
    assert parse_peer("http://127.0.0.1:8001", 0) == ("peer", "http://127.0.0.1:8001")
    assert parse_peer("http://127.0.0.1:8001/", 1) == ("peer2", "http://127.0.0.1:8001")
    assert parse_peer("vllm=http://127.0.0.1:8001", 0) == ("vllm", "http://127.0.0.1:8001")
    for bad in ("127.0.0.1:8001", "vllm=ftp://x", "a b=http://127.0.0.1:1"):
        with pytest.raises(ValueError):
            parse_peer(bad, 0)


def test_a_local_peer_is_found_by_its_port_with_its_children():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        assert listening_pids(port) == [os.getpid()]
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            found = peer_pids(f"http://127.0.0.1:{port}")
            assert found[0] == os.getpid() and child.pid in found
            assert with_descendants([child.pid]) == [child.pid]
        finally:
            child.kill()
            child.wait()
    assert peer_pids("http://10.1.2.3:8000") == []  # another machine: nothing to measure here
