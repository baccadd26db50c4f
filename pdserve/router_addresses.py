"""The routers' addresses a worker registers with (`--router`) and a router asks (`--peers`).

A value is one URL or several, comma-separated. An item `dns+http://NAME:PORT` stands for every
address NAME resolves to, each `http://ADDRESS:PORT`: on Kubernetes a headless Service has one
per router pod, so workers and routers find every replica behind one name. Such a value is
resolved again every `REFRESH_S` (`Refreshed`): a router pod that starts is found within that, and
one that is gone is let go. A name that does not resolve at the start (no router pod yet) gives
no address for now; one that stops resolving for a moment lets nothing go: each refresh that
fails keeps what the last one found.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from typing import Callable
from urllib.parse import urlsplit

log = logging.getLogger("pdserve.addresses")

DNS_PREFIX = "dns+"
REFRESH_S = 5.0
MAX_ADDRESSES = 64  # routers behind one name, at most

Resolver = Callable[[str, int], list[str]]


def resolve_name(host: str, port: int) -> list[str]:
    """Every address `host` has (IPv4 and IPv6), in the resolver's order, without repeats."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in found))


def is_dynamic(spec: str) -> bool:
    return any(item.strip().startswith(DNS_PREFIX) for item in spec.split(","))


def check(spec: str) -> None:
    """A precise ValueError for a value that cannot name routers."""
    items = [item.strip() for item in spec.split(",") if item.strip()]
    if not items:
        raise ValueError("no router address given")
    for item in items:
        url = urlsplit(item.removeprefix(DNS_PREFIX))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"{item!r}: not an http(s) URL (or dns+http://NAME:PORT)")
        if item.startswith(DNS_PREFIX) and url.port is None:
            raise ValueError(f"{item!r}: a dns+ address needs its port")


def expand(spec: str, resolve: Resolver = resolve_name, strict: bool = False) -> list[str]:
    """The URLs `spec` names now (a dns+ item: one per address its name resolves to). A name that
    does not resolve gives none, or with `strict` raises OSError (a refresh keeps what it had)."""
    out: list[str] = []
    for item in (i.strip().rstrip("/") for i in spec.split(",")):
        if not item:
            continue
        if not item.startswith(DNS_PREFIX):
            out.append(item)
            continue
        url = urlsplit(item.removeprefix(DNS_PREFIX))
        try:
            addresses = resolve(url.hostname, url.port)
        except OSError as e:
            if strict:
                raise
            log.warning("%s does not resolve (yet): %s", url.hostname, e)
            continue
        for address in addresses[:MAX_ADDRESSES]:
            host = f"[{address}]" if ipaddress.ip_address(address.split("%")[0]).version == 6 else address
            out.append(f"{url.scheme}://{host}:{url.port}{url.path}")
    return list(dict.fromkeys(out))


class Refreshed:
    """Calls `apply(urls)` with what `spec` names every `REFRESH_S` (only where it has a dns+
    item), on a thread of its own, until stopped."""

    def __init__(self, spec: str, apply: Callable[[list[str]], None], resolve: Resolver = resolve_name,
                 every_s: float = REFRESH_S) -> None:
        self.spec, self.apply, self.resolve, self.every_s = spec, apply, resolve, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-addresses", daemon=True)

    def start(self) -> Refreshed:
        if is_dynamic(self.spec):
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.apply(expand(self.spec, self.resolve, strict=True))
            except OSError as e:  # a refresh that fails keeps what was found before
                log.warning("the routers' addresses were not looked up again: %s", e)
            except Exception:
                log.exception("refreshing the routers' addresses failed")
