"""Secrets never on a command line, internal routes never open: the router and the worker make a
token (in a file only their user reads) when given none, and refuse other addresses without one."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading

import httpx
import pytest

from pdserve.cli import build_parser
from pdserve.credentials import is_loopback, new_token_file, read_secret


def test_read_secret_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_TEST_SECRET", " from-env \n")
    assert read_secret(None, "PDSERVE_TEST_SECRET") == "from-env"
    f = tmp_path / "secret"
    f.write_text("from-file\nignored second line\n")
    f.chmod(0o600)
    assert read_secret(str(f), "PDSERVE_TEST_SECRET") == "from-file"
    f.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        read_secret(str(f), "PDSERVE_TEST_SECRET")
    with pytest.raises(ValueError, match="cannot read"):
        read_secret(str(tmp_path / "missing"), "PDSERVE_TEST_SECRET")


def test_new_token_file_is_for_its_user_only(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    token, path = new_token_file("router-test")
    assert len(token) == 64 and path.read_text().strip() == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    again, _ = new_token_file("router-test")
    assert again != token


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                            ("127.8.9.1", True), ("0.0.0.0", False), ("10.0.0.5", False),
                                            ("example.org", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("argv", [["router", "--token", "abc"], ["router", "--api-key", "abc"],
                                  ["worker", "--token", "abc"], ["serve", "--api-key", "abc"]])
def test_secrets_on_the_command_line_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert "command line" in capsys.readouterr().err


def test_the_benchmark_client_takes_its_key_from_a_file_or_the_environment_only(capsys):
    from pdserve.bench.serving import main as bench_main

    with pytest.raises(SystemExit) as e:
        bench_main(["--api-key", "abc"])
    assert e.value.code == 2
    assert "command line" in capsys.readouterr().err


def run(argv, env, timeout=60):
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)


def clean_env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PDSERVE_TOKEN", "PDSERVE_API_KEY")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    return env


def test_non_loopback_addresses_need_a_token(tiny_llama, tmp_path):
    env = clean_env(tmp_path)
    r = run(["router", "--model", str(tiny_llama), "--host", "0.0.0.0", "--port", "0"], env)
    assert r.returncode == 2 and "needs the workers' token" in r.stderr
    r = run(["worker", "--model", str(tiny_llama), "--host", "0.0.0.0", "--port", "0"], env)
    assert r.returncode == 2 and "needs the cluster's token" in r.stderr
    r = run(["worker", "--model", str(tiny_llama), "--router", "http://127.0.0.1:9"], env)
    assert r.returncode == 2 and "--router needs the cluster's token" in r.stderr


def test_a_router_without_a_token_makes_one(tiny_llama, tmp_path):
    env = clean_env(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "router", "--model", str(tiny_llama), "--port", "0"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()))
        reader.start()
        reader.join(120)
        assert not reader.is_alive(), "the router printed no ready line within 120s"
        ready = json.loads(line[0])
        path = ready["token_file"]
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        token = open(path).read().strip()
        body = {"url": "http://127.0.0.1:1", "role": "decode", "model_hash": "x"}
        assert httpx.post(ready["url"] + "/internal/register", json=body).status_code == 401  # a stranger
        r = httpx.post(ready["url"] + "/internal/register", json=body, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 409 and "model mismatch" in r.json()["error"]["message"]  # past the token check
        assert token not in open(f"/proc/{proc.pid}/cmdline").read()
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stderr.close()
        proc.stdout.close()
