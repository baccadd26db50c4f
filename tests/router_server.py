"""A router in this process, for the tests: built from a tiny checkpoint, served on its real HTTP
endpoint, joined by in-process workers the way a worker process joins it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdserve.kv_transfer.base import model_fingerprint
from pdserve.models.arch_config import ArchConfig
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.router import Router
from pdserve.tokenizer import Tokenizer
from pdserve.worker.registration import RouterMembership
from pdserve.worker.server import ServerThread
from tests.wait import wait_for
from tests.worker.cluster import WorkerServer

MODEL = "tiny"


def make_router(model_dir: Path, **config: Any) -> Router:
    """A router serving `model_dir` as "tiny". Its lease is short (2 s unless `config` says otherwise):
    a test that silences a worker sees it dropped in seconds."""
    arch = ArchConfig.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    config = {"max_model_len": arch.max_position_embeddings, "lease_s": 2.0, **config}
    return Router(RouterConfig(model_name=MODEL, **config), Tokenizer.from_dir(model_dir), model_fingerprint(arch),
                  arch.vocab_size)


class RouterServer:
    """`with RouterServer(model, **config) as rs:` a router behind its HTTP endpoint; `rs.join(w)`
    registers a worker with it (heartbeats and all). Leaving stops the heartbeats, then the router."""

    def __init__(self, model_dir: Path, port: int = 0, **config: Any) -> None:
        self.router = make_router(model_dir, **config)
        app = create_app(self.router)
        self.rounds = app.state.rounds  # reaping, hot-spot relief, the P:D controller
        self.server = ServerThread(app, port=port, lifespan="on").start()
        self.url = self.server.url
        self.members: list[RouterMembership] = []

    def __enter__(self) -> RouterServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        for member in self.members:
            member.stop()
        self.server.stop()

    def join(self, w: WorkerServer) -> RouterMembership:
        """`w` registers in its own role, with the router's worker token; returns once the router has
        its first heartbeat (its load is known, so the policy can route to it)."""
        worker = w.worker
        member = worker.join(self.url, w.url, self.router.config.worker_token)  # as a worker process does
        self.members.append(member)
        wait_for(lambda: any(e.url == w.url and e.heartbeats for e in self.router.registry.workers()), 20,
                 f"the {worker.config.role} worker at {w.url} to register", state=lambda: member.status)
        return member
