"""The engine of a worker, on a thread of its own.

Lifecycle:
1. `start()`: the engine thread runs until `stop()`; on a CPU its OpenMP team is pinned one
   thread a core where the worker may run on exactly as many cores (`bind_team_to_cores`).
2. Other threads never touch the engine: they `call(fn)` closures, run in order on the engine
   thread between steps (add a request, abort, KV landed ...).
3. Each turn: run queued closures, let the role poll its transfer events and timers, step the
   engine if it has runnable work (else wait briefly for a closure), and hand each output to the
   sink its request registered.
4. A request that breaks a step fails alone (the engine runs its batch mates without it). An
   exception from anything else (the role's poll, a sink, a step outside any one request's
   fault) is logged and survived: the thread never dies while the worker lives; a step that
   fails as a whole ends the requests it held with an error, and the loop goes on.
5. With a step log, every step's shape and the engine thread's time for it (its calls, the step
   and handing out its outputs) go to the log as a JSON line: `pdserve profile --from-steps`
   fits the simulator's step model to a worker's steps as it served.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict
from typing import IO, Callable

import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parallel.lost import RanksLost
from pdserve.engine.step_shape import StepShape, step_shape
from pdserve.layers.kernels.native import bind_team_to_cores
from pdserve.outputs import RequestOutput

log = logging.getLogger("pdserve.worker")

IDLE_WAIT_S = 0.02
RANKS_LOST_EXIT = 75  # the worker's exit status when a tensor-parallel rank of its own died
RANKS_LOST_GRACE_S = 0.5
FAILURE_LOG_S = 10.0
EWMA_ALPHA = 0.1

OutputSink = Callable[[RequestOutput | BaseException], None]


class EngineLoop:
    def __init__(self, engine: LLMEngine, poll: Callable[[], None] = lambda: None,
                 step_log: IO[str] | None = None) -> None:
        self.engine = engine
        self.step_log = step_log
        self._shape: StepShape | None = None
        if step_log is not None:
            engine.on_schedule = self._keep_shape
        self.poll = poll  # the role's transfer events and timers, on the engine thread
        self.sinks: dict[str, OutputSink] = {}
        self.step_latency_ewma_s = 0.0
        self.num_steps = 0
        self.num_failures = 0  # exceptions the loop survived
        self.step_delay_s = 0.0  # fault injection: each step takes this much longer (a slow worker)
        self._failures: dict[str, tuple[int, float]] = {}  # kind -> (count since logged, when logged)
        self._calls: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The engine thread runs (False before start, after stop, or if it died)."""
        return self._thread.is_alive() and not self._stopped.is_set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._calls.put(lambda: None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the engine thread, in order with other calls."""
        self._calls.put(fn)

    def submit(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the engine thread; the future holds its result or exception. A future
        cancelled before its turn never runs: a caller that stopped waiting leaves nothing behind."""
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller
                future.set_exception(e)

        self.call(run)
        return future

    def call_and_wait(self, fn: Callable[[], object], timeout: float = 30.0) -> object:
        """Run `fn` on the engine thread and return its result (or raise its exception); TimeoutError
        if the engine has not run it within `timeout` (then it never will)."""
        future = self.submit(fn)
        try:
            return future.result(timeout)
        except TimeoutError:
            if future.cancel():
                raise TimeoutError("the engine did not answer in time") from None
            return future.result()  # it began just now: it ends within the engine's turn

    # -- engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.engine.config.device == "cpu" and bind_team_to_cores():
                log.info("the engine's %d threads are pinned one to a core", torch.get_num_threads())
        except Exception:  # pinning is a speed-up: without it the engine runs, as the scheduler places it
            self._log_failure("pinning the engine's threads")
        while not self._stopped.is_set():
            try:
                self._turn()
            except Exception:  # a bug in a turn must not end the thread the whole worker runs on
                self._log_failure("an engine turn")
                time.sleep(IDLE_WAIT_S)

    def _turn(self) -> None:
        busy = self.engine.has_runnable_work()
        t_turn, cpu_turn = time.perf_counter(), time.thread_time()
        self._run_calls(wait=0.0 if busy else IDLE_WAIT_S)
        try:
            self.poll()
        except Exception:
            self._log_failure("the role's poll")
        if not self.engine.has_runnable_work():
            return
        t0 = time.perf_counter()
        if not busy:  # the turn waited for a call: count from the step's own start
            t_turn, cpu_turn = t0, time.thread_time()
        try:
            outputs = self.engine.step()
        except RanksLost as e:  # a rank of this worker died: the worker is gone too, and restarts whole
            log.critical("%s; failing every request and exiting for the supervisor to restart the worker", e)
            self._fail_all(e)
            time.sleep(RANKS_LOST_GRACE_S)  # the failed requests' errors reach their clients
            os._exit(RANKS_LOST_EXIT)
        except Exception as e:
            self._log_failure("an engine step")
            self._fail_all(e)
            return
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        dt = time.perf_counter() - t0
        self.num_steps += 1
        a = EWMA_ALPHA if self.num_steps > 1 else 1.0
        self.step_latency_ewma_s += a * (dt - self.step_latency_ewma_s)
        for out in outputs:
            self._deliver(out)
        if self._shape is not None:
            self._log_step(t_turn, time.perf_counter() - t_turn, time.thread_time() - cpu_turn)
        if not outputs and not self.engine.scheduler.running:
            self._run_calls(wait=IDLE_WAIT_S / 4)  # waiting requests that cannot be admitted yet

    def _keep_shape(self, step) -> None:
        self._shape = step_shape(step)

    def _log_step(self, t_start: float, seconds: float, cpu_seconds: float) -> None:
        # `at`: the wall clock (shared by every process on the host) when the turn began, so the
        # logs of one cluster line up; `cpu_seconds`: what the engine thread itself ran of it
        # (the rest it waited: for the GIL, for its core, or for its own torch threads)
        at = time.time() - (time.perf_counter() - t_start)
        row = {**asdict(self._shape), "seconds": round(seconds, 6), "cpu_seconds": round(cpu_seconds, 6),
               "at": round(at, 6)}
        try:
            self.step_log.write(json.dumps(row) + "\n")
        except (OSError, ValueError):  # a full disk or a closed log ends the log, not the worker
            log.exception("the step log failed; no more steps are logged")
            self.engine.on_schedule, self.step_log = None, None
        self._shape = None

    def _run_calls(self, wait: float) -> None:
        try:
            fn = self._calls.get(timeout=wait) if wait else self._calls.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                fn()
            except Exception:
                self._log_failure("an engine call")
            try:
                fn = self._calls.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, out: RequestOutput) -> None:
        sink = self.sinks.get(out.request_id)
        if out.finished:
            self.sinks.pop(out.request_id, None)
        if sink is not None:
            try:
                sink(out)
            except Exception:
                self._log_failure("an output sink")

    def _log_failure(self, what: str) -> None:
        """Log with the traceback, at most once every FAILURE_LOG_S per kind (the loop turns every
        few milliseconds: a failure that repeats must not flood the log), with the count since."""
        now = time.monotonic()
        count, last = self._failures.get(what, (0, -FAILURE_LOG_S))
        self._failures[what] = (count + 1, last)
        self.num_failures += 1
        if now - last >= FAILURE_LOG_S:
            log.exception("%s failed (%d times since the last report); the engine goes on", what, count + 1)
            self._failures[what] = (0, now)

    def _fail_all(self, error: Exception) -> None:
        for request_id in self.engine.request_ids():
            self.engine.abort(request_id)
            sink = self.sinks.pop(request_id, None)
            if sink is not None:
                try:
                    sink(error)
                except Exception:
                    self._log_failure("an output sink")
        try:
            self.engine.step()  # drains the aborted outputs; their sinks are gone
        except Exception:
            self._log_failure("an engine step while ending requests")
