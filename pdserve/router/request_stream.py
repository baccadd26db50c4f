"""One request at the router, from the decode worker it was admitted to until its last line: the
request's owner there. It holds the request's state (the workers tried, the tokens so far, its
deadline) and each way a call can end is a method of its own:

1. A call (`_call`): `/v1/generate` on the decode worker (with the prefill worker that sends it
   the prompt's KV, if any) streams output lines, each passed on. It holds the worker's sequence
   slots (`Hold`; the first call, the hold `Router.admit` took) until it ends.
2. The call ends, and:
   - the request finished: done;
   - hot-spot relief moved it (`LiveStream.ask_to_move`, then an abort on the hot worker): it
     continues on the target, which takes its KV from the hot worker's prefix cache (`_move`);
   - the worker's queue was full (503, before the first token; other clients of that worker):
     back off and route again, within the request's deadline: the router admitted it, so it
     waits, not errs (`_after_refusal`);
   - the worker failed mid-stream, and its KV outlives it (`--durable-kv`): the request waits for
     it to come back (its supervisor restarts it) and resumes there from that KV (`_resume_there`);
   - the worker failed or went silent: a broken one is dropped (its other streams fail too); the
     request goes to another worker once before its first token, or after it with
     `migrate_on_failure` (single completions); otherwise the client gets a 502 (`_after_failure`).
3. Routed nowhere (every decode worker holds as many sequences from here as it said it can):
   wait in the router's line until the deadline, then NoRoom (503).
A request continued elsewhere resumes (`output_token_ids`): no token repeated, none missing, and
seeded sampling goes on exactly as if nothing had happened.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from typing import AsyncIterator

import httpx
import msgspec

from pdserve import wire
from pdserve.http_errors import APIError
from pdserve.router.request_trace import RequestTrace
from pdserve.router.router import Router
from pdserve.router.streams import LiveStream, WorkerLost, WorkerSilent, worker_lines
from pdserve.router.waiting_line import Admitted, Hold

log = logging.getLogger("pdserve.router")

FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.05, 1.0  # between asking a full worker's queue again
MAX_WORKERS_FAILED = 2  # a request migrates after at most this many failed workers
RESUME_POLL_S = 0.05  # how often a stream waiting for its restarted worker looks for it


class RequestStream:
    def __init__(self, router: Router, request_id: str, prompt_ids: list[int], sampling: wire.Sampling,
                 priority: int, admitted: Admitted, trace: RequestTrace | None = None, version: str | None = None
                 ) -> None:
        self.router = router
        self.request_id, self.prompt_ids, self.sampling, self.priority = request_id, prompt_ids, sampling, priority
        self.live = LiveStream(request_id, sampling.n, len(prompt_ids), sampling.max_tokens)
        self.admitted = admitted
        self.decode, self.prefill = admitted.decode, admitted.prefill  # None: route again (or wait)
        self.deadline = admitted.deadline  # for waiting for room, in all
        self.backoff_s = FIRST_BACKOFF_S
        self.tried: set[str] = set()  # workers that failed this request
        self.generated: list[int] = []  # single completions: every token so far
        self.started = False  # a line went to the client
        self._moved = False  # the current call ended for a move
        self.resume_of: str | None = None  # the next call resumes this worker request id's kept KV
        self.trace = trace  # its spans, where the router traces
        self.version = version  # the version whose workers serve it (None: the stable one)
        self.again = ""  # why the next call is not the first: hot_spot, resumed, failure or requeued

    async def lines(self) -> AsyncIterator[wire.OutputLine]:
        """The output lines, followed across workers (the module's docstring)."""
        router = self.router
        router.live[self.request_id] = self.live
        try:
            for attempt in itertools.count():
                if self.decode is None:
                    self.decode, self.prefill = await router.route_when_room(
                        self._context(), frozenset(self.tried), self.live.n, self.deadline, self.version)
                hold = self.admitted.hold if attempt == 0 else Hold(router.line, self.decode, self.live.n)
                worker = self.decode
                try:
                    async for item in self._call(attempt):
                        yield item
                    router.rollout.call_ended(worker.version, failed=False)
                    if not self._moved:
                        return
                    self._move()
                except APIError as e:
                    router.rollout.call_ended(worker.version, failed=e.status >= 500 and e.status != 503)
                    await self._after_refusal(e, hold)
                except (httpx.HTTPError, WorkerLost) as e:
                    router.rollout.call_ended(worker.version, failed=True)
                    if not await self._resume_there(e, hold):
                        self._after_failure(e, hold)
                finally:
                    hold.release()
        finally:
            router.live.pop(self.request_id, None)

    async def _call(self, attempt: int) -> AsyncIterator[wire.OutputLine]:
        router, live = self.router, self.live
        live.worker_id, live.worker_request_id = self.decode.worker_id, f"{self.request_id}-{attempt}"
        body = wire.GenerateRequest(request_id=live.worker_request_id, prompt_token_ids=self.prompt_ids,
                                    output_token_ids=list(self.generated), sampling=self.sampling,
                                    priority=self.priority,
                                    prefill_url=self.prefill.url if self.prefill is not None else None,
                                    resume_of=self.resume_of, traceparent=self._traceparent())
        self._moved, self.resume_of = False, None
        async for item in worker_lines(router.http, self.decode.url, body, router.worker_headers, live,
                                       router.config.worker_silence_s):
            if live.n == 1:
                out = item.outputs[0]
                if live.stopped_for_move(out):
                    out.finish_reason, self._moved = None, True  # the client sees no end: it goes on
                self.generated += out.token_ids
                live.tokens_arrived(len(out.token_ids))
            self.started = True
            if item.prompt_logprobs is not None:  # the client has them: a later call does not ask again
                self.sampling = msgspec.structs.replace(self.sampling, prompt_logprobs=None)
            yield item

    def _traceparent(self) -> str:
        if self.trace is None:
            return ""
        return self.trace.call(self.decode.worker_id, self.prefill.worker_id if self.prefill else None, self.again)

    def _move(self) -> None:
        """Continue on relief's target, which takes the KV from the hot worker's cache."""
        self.again = "hot_spot"
        self.decode, self.prefill = self.live.take_move(), self.decode
        self.decode.in_flight += self.live.n  # the next call's hold
        self.router.metrics.migrations.labels("hot_spot").inc()

    async def _after_refusal(self, e: APIError, hold: Hold) -> None:
        """A worker's 503 (its queue is full) before the first token: wait, then route again."""
        if e.status != 503 or self.started or time.monotonic() + self.backoff_s > self.deadline:
            raise e
        self.router.metrics.requeued.inc()
        self.again = "requeued"
        hold.release()
        await asyncio.sleep(self.backoff_s * (0.5 + random.random()))
        self.backoff_s = min(2 * self.backoff_s, MAX_BACKOFF_S)
        self._route_again()

    async def _resume_there(self, e: Exception, hold: Hold) -> bool:
        """A decode worker whose KV pool outlives it failed mid-stream (a single completion): wait
        for its restarted self (the same pool id) to register, within `resume_wait_s`, and continue
        there from the KV it kept. False if it does not come back in time."""
        router, worker = self.router, self.decode
        pool = worker.stats.durable_kv
        if not pool or not self.started or self.live.n != 1 or isinstance(e, WorkerSilent):
            return False
        log.warning("request %s: decode worker %s failed (%s); waiting for it to come back with its KV",
                    self.request_id, worker.url, type(e).__name__)
        router.drop_worker(worker.worker_id, "it failed a request")
        self.live.cancel_move()
        hold.release()
        deadline = time.monotonic() + router.config.resume_wait_s
        while (back := router.registry.with_durable_pool(pool, worker.worker_id)) is None:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(RESUME_POLL_S)
        self.resume_of, self.decode, self.prefill = self.live.worker_request_id, back, None
        self.again = "resumed"
        back.in_flight += self.live.n  # the next call's hold
        router.metrics.migrations.labels("resumed").inc()
        return True

    def _after_failure(self, e: Exception, hold: Hold) -> None:
        """The worker failed the call, or said nothing for too long: elsewhere, or a 502."""
        router, worker = self.router, self.decode
        log.warning("request %s: decode worker %s failed: %s: %s", self.request_id, worker.url, type(e).__name__, e)
        migrate = router.config.migrate_on_failure and self.live.n == 1 and len(self.tried) < MAX_WORKERS_FAILED
        if not isinstance(e, WorkerSilent):  # unreachable or broken: its other streams fail
            router.drop_worker(worker.worker_id, "it failed a request")  # now, not when its lease lapses
        if (self.started or self.tried) and not migrate:  # the client hears no internal address or detail
            raise APIError(502, "the decode worker failed mid-request", "server_error") from None
        self.tried.add(worker.worker_id)
        self.again = "failure"
        if worker.version != router.rollout.stable and not self.started:
            self.version = router.rollout.stable  # a failing canary's request goes on where it can be served
        if isinstance(e, WorkerSilent):
            router.metrics.silent_streams.inc()
        self.live.cancel_move()
        hold.release()
        self._route_again()
        if self.started:
            router.metrics.migrations.labels("failure").inc()

    def _route_again(self) -> None:
        """Workers with room now (held), or none: the next attempt waits in line."""
        self.decode, self.prefill = (self.router.route_or_none(self._context(), frozenset(self.tried), self.live.n,
                                                               self.version) or (None, None))

    def _context(self) -> list[int]:
        return self.prompt_ids + self.generated

