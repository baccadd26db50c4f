"""The chaos benchmark's load: closed-loop clients streaming `/v1/completions` from the router, each
request judged by what the client saw.

Lifecycle of a client:
1. Take the next request of the seeded workload (`loadgen.build_requests`: token-id prompts,
   `ignore_eos`, so a request that ends well has exactly `max_tokens` tokens), until `stop` is set
   or, with a request budget, none is left.
2. Stream it; judge it (`judge`):
   - ok: the stream ended with `[DONE]` and `max_tokens` tokens;
   - error: an HTTP error status, an error in the stream, or a connection that broke (the client
     knows it failed, so it can retry: acceptable under faults);
   - lost: no end within the deadline (a hang), a stream that ended without `[DONE]` and without
     an error, or fewer tokens than asked with no error: a silent failure, which must never happen.
3. After an error, pause a moment (a router that is down refuses at once), then go on.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from dataclasses import dataclass, field

import httpx

from pdserve.workload.loadgen import BenchRequest

OUTCOMES = ("ok", "error", "lost")
ERROR_PAUSE_S = 0.5
REFUSED_STATUS = (429, 503)  # no room, or no worker: the request was not begun
REFUSED_CONNECTION = ("ConnectError", "ConnectTimeout")  # nothing listened, or answered the connection


@dataclass(slots=True)
class RequestResult:
    index: int  # in the seeded workload
    client: int
    max_tokens: int
    start: float  # monotonic seconds, the clock of the supervisor's events
    end: float | None = None
    first_token: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried text
    tokens: int = 0  # the usage the server reported at the end, else chunks with text
    outcome: str = ""  # ok | error | lost
    detail: str = ""  # why it is not ok
    refused: bool = False  # no router took it: the connection failed, or 429/503 (`causes.py`)

    def as_dict(self, t0: float) -> dict:
        rel = lambda t: None if t is None else round(t - t0, 3)  # noqa: E731
        return {"index": self.index, "client": self.client, "start_s": rel(self.start), "end_s": rel(self.end),
                "first_token_s": rel(self.first_token), "tokens": self.tokens, "max_tokens": self.max_tokens,
                "outcome": self.outcome, "detail": self.detail, "refused": self.refused}


@dataclass(slots=True)
class StreamSeen:
    """What one streamed answer showed the client."""

    status: int = 200
    error: str = ""  # from an error status's body or an error event in the stream
    done: bool = False  # `data: [DONE]` came
    usage_tokens: int | None = None
    text_chunks: int = 0
    broken: str = ""  # the connection failed: the exception's name
    malformed: str = ""  # a line that is not JSON


def judge(seen: StreamSeen, max_tokens: int, hung: bool) -> tuple[str, str, int]:
    """(outcome, detail, tokens) of one request from what its stream showed."""
    tokens = seen.usage_tokens if seen.usage_tokens is not None else seen.text_chunks
    if hung:
        return "lost", "no end within the deadline", tokens
    if seen.status != 200:
        return "error", f"HTTP {seen.status}" + (f": {seen.error}" if seen.error else ""), tokens
    if seen.error:
        return "error", f"error in the stream: {seen.error}", tokens
    if seen.broken:
        return "error", f"connection broke: {seen.broken}", tokens
    if seen.malformed:
        return "lost", f"malformed stream line: {seen.malformed[:80]}", tokens
    if not seen.done:
        return "lost", "the stream ended without [DONE] and without an error", tokens
    if tokens < max_tokens:
        return "lost", f"{tokens} of {max_tokens} tokens (ignore_eos) and no error", tokens
    return "ok", "", tokens


async def stream_once(http: httpx.AsyncClient, url: str, payload: dict, result: RequestResult) -> StreamSeen:
    seen = StreamSeen()
    try:
        async with http.stream("POST", url, json=payload) as r:
            seen.status = r.status_code
            if r.status_code != 200:
                seen.error = _error_type(await r.aread())
                return seen
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    seen.done = True
                    continue
                try:
                    chunk = json.loads(data)
                except ValueError:
                    seen.malformed = data
                    continue
                if "error" in chunk:
                    seen.error = (chunk["error"] or {}).get("type") or "error event"
                if chunk.get("usage"):
                    seen.usage_tokens = chunk["usage"].get("completion_tokens")
                if any(c.get("text") for c in chunk.get("choices") or []):
                    now = time.monotonic()
                    result.first_token = result.first_token or now
                    result.chunk_times.append(now)
                    seen.text_chunks += 1
    except httpx.HTTPError as e:
        seen.broken = type(e).__name__
    return seen


def _error_type(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return ""


class ClosedLoopLoad:
    """`concurrency` clients over `requests` (taken in order, cycling when a run outlasts them) until
    `stop` is set, or after `budget` requests; every request's result in `results` as it ends."""

    def __init__(self, url: str, model: str, requests: list[BenchRequest], concurrency: int, deadline_s: float,
                 budget: int | None = None) -> None:
        self.url, self.model, self.requests = url.rstrip("/") + "/v1/completions", model, requests
        self.concurrency, self.deadline_s, self.budget = concurrency, deadline_s, budget
        self.stop = threading.Event()
        self.results: list[RequestResult] = []
        self.in_flight = 0
        self._next = itertools.count()

    def run(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        # no read timeout of httpx's own: a stream that stalls is a hang, judged at the deadline
        timeout = httpx.Timeout(connect=5.0, read=None, write=10.0, pool=None)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
            await asyncio.gather(*(self._client(http, i) for i in range(self.concurrency)))

    async def _client(self, http: httpx.AsyncClient, client: int) -> None:
        while not self.stop.is_set():
            index = next(self._next)
            if self.budget is not None and index >= self.budget:
                return
            req = self.requests[index % len(self.requests)]
            payload = {"model": self.model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            result = RequestResult(index, client, req.max_tokens, time.monotonic())
            self.in_flight += 1
            try:
                seen = await asyncio.wait_for(stream_once(http, self.url, payload, result), self.deadline_s)
                hung = False
            except TimeoutError:
                seen, hung = StreamSeen(), True
            finally:
                self.in_flight -= 1
            result.end = time.monotonic()
            result.outcome, result.detail, result.tokens = judge(seen, req.max_tokens, hung)
            result.refused = seen.status in REFUSED_STATUS or seen.broken in REFUSED_CONNECTION
            self.results.append(result)
            if result.outcome != "ok":
                await asyncio.sleep(ERROR_PAUSE_S)

    def counts(self) -> dict[str, int]:
        return {o: sum(r.outcome == o for r in self.results) for o in OUTCOMES}
