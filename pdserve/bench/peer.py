"""An OpenAI-compatible server someone else started (vLLM, SGLang, llama.cpp's server, another
pdserve) as one more row of `pdserve bench compare`.

When it listens on this machine, its processes are found by the port (the socket's inode in
/proc/net/tcp, then the process holding it) together with their children (vLLM runs its engine in
a child process): their CPU counts as the server's own, not as a neighbour's noise, and their
memory is measured as a local cluster's is.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

from pdserve.credentials import is_loopback

LISTEN = "0A"  # TCP state in /proc/net/tcp


def parse_peer(text: str, index: int) -> tuple[str, str]:
    """`[NAME=]URL` -> (name, url); an unnamed peer is `peer` (then `peer2`, ...)."""
    name, sep, url = text.partition("=")
    if not sep or "://" in name:
        name, url = ("peer" if index == 0 else f"peer{index + 1}"), text
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--peer-url takes [NAME=]http://HOST:PORT; got {text!r}")
    if not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"a peer's name is letters, digits, - and _; got {name!r}")
    return name, url.rstrip("/")


def peer_pids(url: str) -> list[int]:
    """The processes serving `url` on this machine, children included; [] for another machine."""
    parts = urlsplit(url)
    if not parts.hostname or not is_loopback(parts.hostname):
        return []
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return with_descendants(listening_pids(port))


def listening_pids(port: int) -> list[int]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    pids = []
    for proc in _processes():
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                pids.append(int(proc.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def with_descendants(pids: list[int]) -> list[int]:
    parents = {}
    for proc in _processes():
        try:
            parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found = list(dict.fromkeys(pids))
    for pid in found:  # grows as children are found
        found += [child for child, parent in parents.items() if parent == pid and child not in found]
    return found


def _processes():
    return (p for p in Path("/proc").iterdir() if p.name.isdigit())
