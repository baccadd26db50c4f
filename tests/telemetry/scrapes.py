"""Real expositions of the router's /metrics for the telemetry tests: a `RouterMetrics` driven by
request clocks and rendered with registry entries built from heartbeats' stats, as the router
renders them."""

from __future__ import annotations

import time

from pdserve.router.metrics import RequestClock, RouterMetrics
from pdserve.router.policy import Admission, WorkerLoad
from pdserve.router.registry import WorkerEntry
from pdserve.wire import WorkerStats


def worker_entry(worker_id: str, role: str, **stats) -> WorkerEntry:
    """A registered worker whose last heartbeat, just now, said `stats`."""
    said = WorkerStats(role=role, **stats)
    return WorkerEntry(worker_id, f"http://127.0.0.1:9/{worker_id}", role, "", lease_expires=0.0,
                       load=WorkerLoad.from_stats(said), stats=said, last_heartbeat=time.monotonic())


def finish_request(metrics: RouterMetrics, ttft_s: float, tokens: int = 4, outcome: str = "ok",
                   transfer_s: float | None = None) -> None:
    """One request through its clock: first token `ttft_s` after it started, `tokens` in all; with
    `transfer_s`, prefilled remotely and its KV transfer took that long."""
    clock = RequestClock(metrics, prompt_tokens=8, remote=transfer_s is not None,
                         start=time.perf_counter() - ttft_s)
    clock.output_line(1, None)
    phases = {"queue_s": 0.001, "prefill_s": 0.01, "transfer_s": transfer_s or 0.0, "decode_s": 0.002}
    clock.output_line(tokens - 1, phases)
    clock.finish(outcome)


def exposition(metrics: RouterMetrics, workers: list[WorkerEntry], queued_requests: int = 0) -> str:
    """What GET /metrics answers with these workers registered and requests held in the router."""
    admission = Admission()
    for i in range(queued_requests):
        admission.try_admit(f"held-{i}", 100)
    return metrics.render(admission, workers).decode()
