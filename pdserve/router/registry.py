"""The router's registry of workers: registration with a token, leases renewed by heartbeats.

Lifecycle of a worker in the registry:
1. `register`: the token is checked (constant time) and the model must be the cluster's; the
   worker gets an id and a lease of `lease_s` seconds.
2. `heartbeat`: renews the lease and stores the worker's stats (its load, for the policies).
   Between two heartbeats the router counts what it sends each worker (`note_routed`), and the
   policies see the last heartbeat's load plus that (`current_load`): a burst of requests spreads
   over the workers instead of piling onto the one that looked idlest a heartbeat ago.
3. `expire`: a worker whose lease ran out is removed and returned, so that its requests can be
   handled as failures; a later heartbeat from it is refused (it must register again).

Versions: a worker registers with a version label (its build or model; "" unlabelled). Unlabelled
workers must serve the router's model, and so must the first worker of a label unless the caller
lets that version differ (`new_model_ok`: a version other than the stable one, which a rollout or
shadow may try); the first worker of a label fixes the model its version serves, and each later
one must serve it too (a version is one model). Routing keeps requests and
their KV among the workers of one version (`router/rollout.py` says which version a request goes to).
"""

from __future__ import annotations

import dataclasses
import hmac
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from pdserve.errors import OtherModel, RegistrationError
from pdserve.router.policy import WorkerLoad
from pdserve.wire import WorkerStats

ROLES = ("prefill", "decode", "both")
MAX_SEEN_URLS = 4096
MAX_VERSIONS = 64  # labels the registry remembers the model of


@dataclass(slots=True)
class WorkerEntry:
    worker_id: str
    url: str
    role: str
    model_hash: str
    lease_expires: float
    load: WorkerLoad = field(default_factory=WorkerLoad)
    stats: WorkerStats = field(default_factory=WorkerStats)
    heartbeats: int = 0  # received since registration
    last_heartbeat: float = 0.0  # time.monotonic() of the last one (or of registration)
    routed: list[tuple[str, int]] = field(default_factory=list)  # since the last heartbeat: (how, prompt tokens)
    in_flight: int = 0  # sequences this router has sent it that have not ended
    block_size: int = 16  # tokens per KV block of its engine (its prefix cache hashes blocks of this size)
    node: str = ""  # the machine it runs on, as it said at registration (host name, Ray node)
    rejoined: bool = False  # a worker at this address registered before: it restarted (or was dropped)
    version: str = ""  # the version label it registered with

    def has_room(self, sequences: int) -> bool:
        """Whether `sequences` more fit within the capacity its heartbeat reported (unknown: yes)."""
        capacity = self.load.capacity
        return not capacity or self.in_flight + sequences <= capacity or not self.in_flight

    def current_load(self) -> WorkerLoad:
        """The last heartbeat's load, plus the requests routed here since: a prompt to compute
        waits with its tokens queued; a request whose KV another worker computes is a session
        waiting for it."""
        if not self.routed:
            return self.load
        local = [n for how, n in self.routed if how != "remote"]
        return dataclasses.replace(self.load, waiting=self.load.waiting + len(local),
                                   queued_prefill_tokens=self.load.queued_prefill_tokens + sum(local),
                                   waiting_for_kv=self.load.waiting_for_kv + len(self.routed) - len(local))

    @property
    def decodes(self) -> bool:
        return self.role in ("decode", "both")

    @property
    def prefills(self) -> bool:
        return self.role in ("prefill", "both")


class Registry:
    def __init__(self, model_hash: str, token: str = "", lease_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model_hash = model_hash
        self._token = token.encode()
        self.lease_s = lease_s
        self.clock = clock
        self._workers: dict[str, WorkerEntry] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._seen_urls: dict[str, None] = {}  # addresses that registered, oldest first (at most MAX_SEEN_URLS)
        self._version_models: dict[str, str] = {"": model_hash}  # label -> the model its workers serve

    def register(self, url: str, role: str, model_hash: str, token: str = "", block_size: int = 16,
                 node: str = "", version: str = "", new_model_ok: bool = False) -> WorkerEntry:
        if not hmac.compare_digest(token.encode(), self._token):
            raise RegistrationError("bad token")
        if role not in ROLES:
            raise RegistrationError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if block_size < 1 or block_size & (block_size - 1):
            raise RegistrationError(f"block_size must be a power of two, got {block_size}")
        with self._lock:
            expected = self._version_models.get(version, None if new_model_ok else self.model_hash)
            if expected is not None and model_hash != expected:
                what = f"version {version!r}" if version else "the cluster"
                raise OtherModel(f"model mismatch: {what} serves {expected[:12]}, the worker {model_hash[:12]}")
            if version not in self._version_models:
                if len(self._version_models) >= MAX_VERSIONS:
                    raise RegistrationError(f"at most {MAX_VERSIONS} versions are served at once")
                self._version_models[version] = model_hash
            for entry in self._workers.values():
                if entry.url == url:  # a restarted worker at the same address replaces its old entry
                    del self._workers[entry.worker_id]
                    break
            rejoined = url in self._seen_urls
            self._seen_urls.pop(url, None)
            self._seen_urls[url] = None  # newest last
            if len(self._seen_urls) > MAX_SEEN_URLS:
                del self._seen_urls[next(iter(self._seen_urls))]
            entry = WorkerEntry(f"w{next(self._ids)}", url, role, model_hash, self.clock() + self.lease_s,
                                last_heartbeat=time.monotonic(), block_size=block_size, node=node, rejoined=rejoined,
                                version=version)
            self._workers[entry.worker_id] = entry
        return entry

    def heartbeat(self, worker_id: str, stats: WorkerStats, token: str = "") -> WorkerEntry:
        """Renew the lease, and take the worker's load from its stats."""
        if not hmac.compare_digest(token.encode(), self._token):
            raise RegistrationError("bad token")
        with self._lock:
            entry = self._workers.get(worker_id)
            if entry is None:
                raise KeyError(worker_id)
            entry.lease_expires = self.clock() + self.lease_s
            entry.last_heartbeat = time.monotonic()
            entry.stats = stats
            entry.heartbeats += 1
            entry.load = WorkerLoad.from_stats(stats)
            entry.routed.clear()  # the worker has them by now: its load includes them
            return entry

    def note_routed(self, worker_id: str, prompt_tokens: int, remote: bool = False) -> None:
        """A request went to this worker: to compute `prompt_tokens` of its prompt, or (`remote`)
        to decode once another worker has sent its KV."""
        with self._lock:
            entry = self._workers.get(worker_id)
            if entry is not None:
                entry.routed.append(("remote" if remote else "local", prompt_tokens))

    def expire(self) -> list[WorkerEntry]:
        now = self.clock()
        with self._lock:
            gone = [e for e in self._workers.values() if e.lease_expires < now]
            for e in gone:
                del self._workers[e.worker_id]
        return gone

    def remove(self, worker_id: str) -> WorkerEntry | None:
        with self._lock:
            return self._workers.pop(worker_id, None)

    def with_durable_pool(self, pool: str, other_than: str) -> WorkerEntry | None:
        """The live worker (not `other_than`) that says it holds the durable KV pool `pool`."""
        with self._lock:
            return next((e for e in self._workers.values()
                         if e.stats.durable_kv == pool and e.worker_id != other_than and not e.stats.draining), None)

    def workers(self, role: str | None = None, version: str | None = None) -> list[WorkerEntry]:
        """The registered workers (of `role`'s side, of `version`: None for any)."""
        with self._lock:
            entries = [e for e in self._workers.values() if version is None or e.version == version]
        if role == "decode":
            return [e for e in entries if e.decodes]
        if role == "prefill":
            return [e for e in entries if e.prefills]
        return entries

    def at_url(self, url: str) -> WorkerEntry | None:
        """The worker registered at `url` (the address every router knows it by)."""
        with self._lock:
            return next((e for e in self._workers.values() if e.url == url.rstrip("/")), None)

    def versions(self) -> set[str]:
        """The version labels of the workers registered now."""
        with self._lock:
            return {e.version for e in self._workers.values()}

    def model_of(self, version: str) -> str | None:
        """The model a version's workers serve (None: no worker of it ever registered)."""
        with self._lock:
            return self._version_models.get(version)

    def get(self, worker_id: str) -> WorkerEntry | None:
        return self._workers.get(worker_id)
