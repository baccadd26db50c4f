"""A prefill and a decode worker in this process, each behind its real HTTP endpoint."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx

from pdserve.worker.server import ServerThread, create_app
from pdserve.worker.config import WorkerConfig
from pdserve.worker.worker import Worker
from tests.backends import TRANSFER, cases, usable
from tests.factories import engine_config
from tests.wait import wait_for

BACKENDS = usable(TRANSFER)  # for loops inside one test; parametrize over CASES instead
CASES = cases(TRANSFER)  # unusable backends appear as skipped cases, with the reason
# and the in-process one: the same leases, fences and aborts without a KV socket (both workers of a
# Cluster live in this process)
CASES_WITH_MEMORY = cases(TRANSFER + ["memory"])


def prompt(length: int, seed: int = 0) -> list[int]:
    return [(seed * 31 + j * 7 + length) % 250 + 1 for j in range(length)]


class WorkerServer:
    """`with WorkerServer(model, "decode", ["tcp"]) as w:` one worker and its HTTP endpoint."""

    def __init__(self, model: Path, role: str, transfer: list[str], token: str = "", worker_args=None,
                 fault_injection: bool = False, tracer=None, **engine):
        settings = WorkerConfig(transfer=",".join(transfer), **(worker_args or {}))
        self.worker = Worker(engine_config(model, role, **engine), settings, token, tracer=tracer)
        self.worker.start()
        self.server = ServerThread(create_app(self.worker, token, fault_injection=fault_injection)).start()
        self.url = self.server.url

    def __enter__(self) -> WorkerServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.server.stop()
        self.worker.stop()

    def is_idle(self) -> bool:
        w = self.worker

        def check() -> bool:
            blocks, sched = w.engine.block_manager, w.engine.scheduler
            return (
                blocks.num_free_blocks == blocks.num_blocks
                and not sched.has_unfinished()
                and not w.engine.has_unfinished_requests()
                and not (w.decode and (w.decode.leases or w.decode.targets))
                and not (w.receiver and w.receiver.num_open_leases)
                and not (w.prefill and w.prefill.shipments)
            )
        return w.loop.call_and_wait(check)


class Cluster:
    """`with Cluster(model, "tcp") as c:` one prefill worker, one decode worker. `backend` is the KV
    transfer backend, or several in order of preference ("tcp,shm"), as `--transfer` takes them."""

    def __init__(self, model: Path, backend: str, prefill: dict | None = None, decode: dict | None = None,
                 token: str = "", decode_worker: dict | None = None, fault_injection: bool = False) -> None:
        transfer = backend.split(",")
        self.p = WorkerServer(model, "prefill", transfer, token, fault_injection=fault_injection, **(prefill or {}))
        self.d = WorkerServer(model, "decode", transfer, token, worker_args=decode_worker,
                              fault_injection=fault_injection, **{"block_size": 8, **(decode or {})})
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(timeout=60, headers=self.headers)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.http.close()
        self.p.stop()
        self.d.stop()

    def body(self, tokens: list[int], max_tokens: int = 8, prefill: bool = True, **sampling: Any) -> dict:
        return {
            "prompt_token_ids": tokens,
            "sampling": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, **sampling},
            "prefill_url": self.p.url if prefill else None,
        }

    def stream(self, tokens: list[int], **kw: Any) -> Iterator[dict]:
        with self.http.stream("POST", self.d.url + "/v1/generate", json=self.body(tokens, **kw)) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                yield json.loads(line)

    def generate(self, tokens: list[int], **kw: Any) -> tuple[list[int], dict]:
        lines = list(self.stream(tokens, **kw))
        return [t for line in lines for t in line["outputs"][0]["token_ids"]], lines[-1]

    def generate_many(self, prompts: list[list[int]], **kw: Any) -> list[list[int]]:
        results: list = [None] * len(prompts)

        def run(i: int) -> None:
            results[i] = self.generate(prompts[i], **kw)[0]
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
            assert not t.is_alive(), "a request had not ended after 120s"
        return results

    def wait_idle(self, timeout: float = 15.0) -> None:
        """Both workers back to no request, no lease, every block free (the leak check)."""
        wait_for(lambda: self.p.is_idle() and self.d.is_idle(), timeout, "both workers idle",
                 state=lambda: f"prefill {self.p.worker.stats()}, decode {self.d.worker.stats()}")


class HeldAtToken:
    """Hold a worker's engine thread in the first step in which a request has `num_tokens` output
    tokens, until `release` is set; `request` is that request. Meanwhile every `worker.abort` call
    is counted (`aborts`, set once one has been queued on the engine): an abort queued while the
    engine is held runs before its next step, so a request aborted then ends with exactly
    `num_tokens + 1` tokens (the held step's own token is still applied), however fast the engine."""

    def __init__(self, worker: Worker, num_tokens: int) -> None:
        self.reached, self.release, self.aborts = threading.Event(), threading.Event(), threading.Event()
        self.num_tokens = num_tokens
        self.request = None
        self._worker, self._hooks = worker, worker.engine.hooks
        self._abort = worker.abort
        worker.abort = self._counting_abort
        self._hooks.after_execute = self._after_execute  # shadows the class's hook on this instance

    def _after_execute(self, step) -> None:
        type(self._hooks).after_execute(self._hooks, step)
        if self.reached.is_set():
            return
        for req in step.requests:
            if len(req.output_token_ids) >= self.num_tokens:
                self.request = req
                self.reached.set()
                self.release.wait(60)  # only a bound on a broken test; `restore` releases it
                return

    def _counting_abort(self, request_id: str) -> None:
        self._abort(request_id)
        self.aborts.set()

    def restore(self) -> None:
        self.release.set()
        self._worker.abort = self._abort
        del self._hooks.after_execute

    def __enter__(self) -> HeldAtToken:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
