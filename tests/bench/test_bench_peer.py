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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_peer_started_by_command_serves_until_stopped_with_its_children(tiny_llama, tmp_path):
    """A real router of the tiny model as the peer: up for its rows, then its whole group gone."""
    from pdserve.bench.peer_process import PeerProcess

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = f"{sys.executable} -m pdserve.cli router --model {tiny_llama} --port {port}"
    peer = PeerProcess("p", url, command, tmp_path / "peer.log", timeout_s=120)
    try:
        serving = peer_pids(url)
        assert serving and all(pid != os.getpid() for pid in serving)
        with pytest.raises(RuntimeError, match="already listens"):  # a second one would measure the first
            PeerProcess("p", url, command, tmp_path / "again.log", timeout_s=5)
    finally:
        peer.stop()
    assert peer.proc.poll() is not None and listening_pids(port) == []


def test_a_peer_command_that_exits_is_an_error_naming_its_log(tmp_path):
    from pdserve.bench.peer_process import PeerProcess

    with pytest.raises(RuntimeError, match="exited; see .*peer.log"):
        PeerProcess("p", f"http://127.0.0.1:{_free_port()}", "echo no server here; exit 3", tmp_path / "peer.log")
    assert "no server here" in (tmp_path / "peer.log").read_text()


def test_a_peer_command_needs_a_peer_url_of_its_name():
    from pdserve.bench.compare import main

    with pytest.raises(SystemExit):
        main(["--configs", "", "--peer-url", "a=http://127.0.0.1:1", "--peer-command", "b=true"])
    with pytest.raises(SystemExit):
        main(["--configs", "", "--peer-url", "a=http://127.0.0.1:1", "--peer-command", "a="])
