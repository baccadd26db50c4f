"""Answering one OpenAI request: admission, the decode worker's token stream turned into OpenAI
JSON or SSE, the router's own detokenization, keep-alive comments, metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.detokenizer import IncrementalDetokenizer
from pdserve.http_clients import ClientGone, StallGuardedStreamingResponse, unless_disconnected
from pdserve.http_errors import APIError
from pdserve.router.logprobs import LogprobsFormat, joined
from pdserve.router.metrics import RequestClock
from pdserve.router.prompts import prepare
from pdserve.router.protocol import ChatCompletionRequest, CompletionRequest, new_id, now, usage
from pdserve.router.request_stream import RequestStream
from pdserve.router.request_trace import RequestTrace
from pdserve.router.router import Router
from pdserve.router.streams import get_within
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer
from pdserve.wire import CompletionDelta, OutputLine, TokenLogprob

OUTBOX_ITEMS = 64  # output lines a streamed response holds for its client before the worker waits


class Detokenizers:
    """The text of each completion of a request: the router is the one place where tokens become
    text (workers stream token ids only). Continuous across a migration to another worker (a
    character split between them is not lost), with stop strings cut exactly: a stop string ends
    its completion here, and the tokens a worker still sends for it are dropped, not counted."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str],
                 stop_on_worker: Callable[[int], None] = lambda index: None, skip_special_tokens: bool = True
                 ) -> None:
        self.params = SamplingParams(stop=stop, skip_special_tokens=skip_special_tokens)
        # a special token that stopped a completion is not its text, even where special tokens are
        # kept (vLLM's rule; a stop token id that is not special stays, as there)
        self.special_ids = tokenizer.all_special_ids if tokenizer is not None else set()
        self.stop_on_worker = stop_on_worker
        self.tokenizer, self.prompt_ids = tokenizer, prompt_ids
        self.by_index: dict[int, IncrementalDetokenizer] = {}
        self.num_tokens = 0  # completion tokens taken, over all completions
        self.stopped: list[int] = []  # completions whose stop string was found here, not yet told

    def delta(self, out: CompletionDelta) -> tuple[str, str | None, list[TokenLogprob]]:
        """(new text, finish reason, the taken tokens' log-probabilities, where asked for) of one
        completion's output line."""
        d = self.by_index.get(out.index)
        if d is None:
            d = self.by_index[out.index] = IncrementalDetokenizer(self.tokenizer, self.prompt_ids, self.params)
        elif d.stop_string is not None:
            return "", None, []  # ended here already
        reason = out.finish_reason
        taken = 0
        last = len(out.token_ids) - 1
        for i, token in enumerate(out.token_ids):
            self.num_tokens += 1
            if i == last and out.finish_reason == "stop" and token in self.special_ids:
                taken += 1
                break
            d.add(token)
            taken += 1
            if d.stop_string is not None:
                reason = "stop"
                if out.finish_reason is None:
                    self.stopped.append(out.index)
                break
        if reason is not None:
            d.flush()
        return d.take_delta(reason is not None), reason, (out.logprobs or [])[:taken]

    def line(self, item: OutputLine, clock: RequestClock) -> list[tuple[int, str, str | None, list[TokenLogprob]]]:
        """(index, new text, finish reason, log-probabilities) of each completion in a worker's
        line; the tokens taken reach the request's clock, and a completion stopped here while
        others go on is stopped on the worker (`stop_on_worker(index)`; once all are, the stream
        itself ends)."""
        before = self.num_tokens
        deltas = [(out.index, *self.delta(out)) for out in item.outputs]
        clock.output_line(self.num_tokens - before, item.phase_times)
        stopped, self.stopped = self.stopped, []
        if not self.finished:
            for index in stopped:
                self.stop_on_worker(index)
        return deltas

    @property
    def finished(self) -> bool:
        return bool(self.by_index) and all(d.stop_string is not None for d in self.by_index.values())


class Echo:
    """Completions' `echo`: each completion's answer begins with the prompt, and its logprobs with
    the prompt's (the first token's none), which come with the first token's line."""

    def __init__(self, text: str, prompt_ids: list[int], n: int, shapes: LogprobsFormat | None) -> None:
        self.text, self.prompt_ids, self.n, self.shapes = text, prompt_ids, n, shapes
        self.done = False

    def choices(self, entries: list[TokenLogprob | None] | None) -> list[tuple[int, str, dict | None]]:
        """(index, the prompt's text, its logprobs) of each completion, once."""
        self.done = True
        return [(i, self.text, self.shapes.prompt(i, self.prompt_ids, entries) if self.shapes else None)
                for i in range(self.n)]


async def serve(router: Router, req: CompletionRequest | ChatCompletionRequest, chat: bool, request: Request):
    prompts = [None] if chat else req.prompts()
    if len(prompts) > 1:
        answer = await _several(router, req, prompts, request)
    else:
        if not chat and prompts[0] is not req.prompt:  # a list of one prompt: that prompt
            req = req.model_copy(update={"prompt": prompts[0]})
        answer = await _serve_one(router, req, chat, request)
    return JSONResponse(answer) if isinstance(answer, dict) else answer


async def _several(router: Router, req: CompletionRequest, prompts: list, request: Request):
    """A completions request of several prompts: each answered as a request of its own, at once;
    one answer, its choices numbered prompt by prompt. One that fails fails the whole (the others
    are cancelled, their workers told)."""
    if req.stream:
        raise APIError(400, "several prompts in one streamed request are not served; send them one by one",
                       param="prompt")
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_serve_one(router, req.model_copy(update={"prompt": p}), False, request))
                     for p in prompts]
    except BaseExceptionGroup as failed:  # the first prompt's error is the answer's
        raise failed.exceptions[0] from None
    answers = [t.result() for t in tasks]
    if any(not isinstance(a, dict) for a in answers):  # the client left
        return Response(status_code=499)
    choices = [{**c, "index": i * req.n + c["index"]} for i, a in enumerate(answers) for c in a["choices"]]
    total = {k: sum(a["usage"][k] for a in answers) for k in answers[0]["usage"]}
    return {**answers[0], "choices": choices, "usage": total}


async def _serve_one(router: Router, req: CompletionRequest | ChatCompletionRequest, chat: bool, request: Request
                     ) -> dict | Response:
    """One prompt's answer: its body (not streamed), or the response itself (streamed; 499 when
    the client left)."""
    request_id = new_id("chatcmpl" if chat else "cmpl")
    trace = (RequestTrace(router.tracer, request.headers.get("traceparent"), chat, req.model, request_id)
             if router.tracer is not None else None)
    try:
        ids, sampling = await asyncio.to_thread(prepare, req, router.config, router.tokenizer, router.vocab_size,
                                                router.grammars, router.tool_calls)  # tokenizing, grammars: off the loop
        if not router.admission.try_admit(request_id, len(ids)):
            raise APIError(429, "the server is at its queue limit; retry shortly", "rate_limit_error",
                           headers={"Retry-After": "1"})
        version = router.rollout.pick()  # stable, or the canary with its share
        try:
            await unless_disconnected(request, router.await_workers())  # a fresh router fills up first
            admitted = await unless_disconnected(request, router.admit(ids, sampling.n, version))  # may wait in line
        except BaseException:  # the client left, no worker, or still no room at the queue timeout
            router.admission.release(request_id)
            raise
    except ClientGone:
        if trace is not None:
            trace.finish("cancelled", 0, 0)
        return Response(status_code=499)  # nobody reads it
    except BaseException:  # refused before any byte (400, 429, 503)
        if trace is not None:
            trace.finish("error", 0, 0)
        raise
    if trace is not None:
        trace.admitted(admitted.decode.worker_id if admitted.decode else "",
                       admitted.prefill.worker_id if admitted.prefill else None)
    flow = RequestStream(router, request_id, ids, sampling, req.priority, admitted, trace,
                         admitted.decode.version if admitted.decode else version)
    stream = flow.lines()
    copy = router.shadow.mirror(ids, sampling) if router.shadow is not None else None
    if copy is not None:
        copy.primary_tokens = flow.generated
    tools = router.tool_calls if chat and req.calls_tools else None
    detok = Detokenizers(router.tokenizer, ids, req.stop_strings(),
                         lambda index: router.stop_completion(request_id, index),
                         skip_special_tokens=not (tools and tools.keeps_special_tokens))
    clock = RequestClock(router.metrics, len(ids), remote=admitted.prefill is not None, trace=trace,
                         rollout=router.rollout, version=admitted.decode.version if admitted.decode else version,
                         shadow=copy)
    shapes = LogprobsFormat(router.tokenizer, chat) if sampling.logprobs is not None else None
    echo = Echo(req.prompt if isinstance(req.prompt, str) else router.tokenizer.decode(ids), ids, req.n, shapes
                ) if req.echoed() else None
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def never_streamed() -> None:  # what `_sse` releases, for a response whose first write never came
            admitted.release()
            router.admission.release(request_id)
            clock.finish("cancelled")
        return StallGuardedStreamingResponse(
            _sse(router, request_id, req, stream, clock, detok, chat, include_usage, shapes, echo),
            stall_s=router.config.client_stall_s, on_close=never_streamed, media_type="text/event-stream")
    outcome = "error"
    texts: dict[int, list[str]] = {}
    reasons: dict[int, str | None] = {}
    logprobs: dict[int, list[dict]] = {}

    async def collect() -> None:
        async with contextlib.aclosing(stream) as items:  # leaving early closes the worker's stream
            async for item in items:
                if echo is not None and not echo.done:
                    for index, text, shape in echo.choices(item.prompt_logprobs):
                        texts.setdefault(index, []).append(text)
                        logprobs.setdefault(index, []).append(shape)
                for index, text, reason, entries in detok.line(item, clock):
                    if reason is not None or index not in reasons:  # a stopped completion stays stopped
                        reasons[index] = reason
                    texts.setdefault(index, []).append(text)
                    if shapes is not None:
                        logprobs.setdefault(index, []).append(shapes.shape(index, entries))
                if detok.finished:
                    break
    try:
        await unless_disconnected(request, collect())  # a client that left stops its request
        outcome = "ok"
    except ClientGone:
        outcome = "cancelled"
        return Response(status_code=499)  # nobody reads it
    finally:
        admitted.release()  # a stream that never started leaves its first hold here (else a no-op)
        router.admission.release(request_id)
        clock.finish(outcome)
    completion_tokens = clock.tokens
    choices = []
    for i in sorted(texts):
        text = "".join(texts[i])
        choice = {"index": i, "finish_reason": reasons[i],
                  "logprobs": joined([p for p in logprobs[i] if p is not None]) if shapes is not None else None}
        if chat:
            content, calls = router.tool_calls.parse(text) if req.calls_tools else (text, [])
            choice["message"] = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            if calls:
                choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = text
        choices.append(choice)
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": now(),
            "model": req.model, "choices": choices, "usage": usage(len(ids), completion_tokens)}


async def _sse(router: Router, request_id: str, req, stream, clock: RequestClock, detok: Detokenizers, chat: bool,
               include_usage: bool, shapes: LogprobsFormat | None, echo: Echo | None):
    kind = "chat.completion.chunk" if chat else "text_completion"
    created = now()
    outcome = "cancelled"

    def event(choices: list, **extra) -> bytes:
        chunk = {"id": request_id, "object": kind, "created": created, "model": req.model, "choices": choices, **extra}
        return f"data: {json.dumps(chunk)}\n\n".encode()

    held = {i: router.tool_calls.stream() for i in range(req.n)} if chat and req.calls_tools else None
    try:
        if chat:
            yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                         for i in range(req.n)])
        async with contextlib.aclosing(_with_keepalive(stream, router.config.keepalive_s)) as items:
            async for item in items:
                if item is None:  # nothing for a while (queued, prefilling): tell the client we are here
                    yield b": keep-alive\n\n"
                    continue
                if echo is not None and not echo.done:  # a chunk of its own, before the first token's
                    yield event([{"index": index, "text": text, "logprobs": shape, "finish_reason": None}
                                 for index, text, shape in echo.choices(item.prompt_logprobs)])
                choices = []
                for index, text, reason, entries in detok.line(item, clock):
                    calls: list[dict] = []
                    if held is not None:  # text that may begin a tool call waits until it cannot
                        text, calls = held[index].feed(text)
                        if reason is not None:
                            rest, last = held[index].finish()
                            text, calls = text + rest, calls + last
                            if held[index].called and reason == "stop":
                                reason = "tool_calls"
                    if not text and reason is None and not entries and not calls:
                        continue
                    body = {"delta": {"content": text}} if chat else {"text": text}
                    if calls:
                        body["delta"]["tool_calls"] = calls
                        if not text:
                            del body["delta"]["content"]
                    body["logprobs"] = shapes.shape(index, entries) if shapes is not None else None
                    choices.append({"index": index, **body, "finish_reason": reason})
                if choices:
                    yield event(choices)
                if detok.finished:
                    break
        outcome = "ok"
        if include_usage:
            yield event([], usage=usage(clock.prompt_tokens, clock.tokens))
        yield b"data: [DONE]\n\n"
    except APIError as e:
        outcome = "error"
        error = {"error": {"message": e.message, "type": e.kind, "param": None, "code": e.status}}
        yield f"data: {json.dumps(error)}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:
        router.admission.release(request_id)
        clock.finish(outcome)


async def _with_keepalive(stream: AsyncIterator[dict], interval: float) -> AsyncIterator[dict | None]:
    """The stream's items, and None whenever `interval` seconds pass without one. The stream is
    read by a task of its own, so waiting never cancels it; closing this closes the stream."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=OUTBOX_ITEMS)  # full: the worker's stream waits
    done = object()

    async def pump() -> None:
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(done)
        except BaseException as e:  # handed over to the reader, cancellation included
            await queue.put(e)

    task = asyncio.create_task(pump())
    try:
        while True:
            item = await get_within(queue, interval)
            if item is None:
                yield None
                continue
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        await stream.aclose()
