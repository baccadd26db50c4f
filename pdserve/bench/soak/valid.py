"""The soak's valid traffic: completions and chat, streamed and not, through the official `openai`
client and through raw httpx, with n up to 4, seeds, stop strings, temperature 0 and above, short
max_tokens; and costly requests (n=16, long prompts, EOS ignored).

Every answer is checked for its shape (one choice per n, a finish reason each, `[DONE]` at the end
of a stream, usage within bounds). A greedy request for a reference prompt must give the text that
prompt got when sent alone (cut at its stop string, if any): a wrong answer under load is a failure.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field

from pdserve.bench.soak.outcomes import SERVED, Outcome, classify_response
from pdserve.bench.soak.target import CHAT_PROMPTS, COMPLETION_PROMPTS, SoakClient, Target, prompt_fields

COMMON_STOPS = [".", "\n", " the", "!", ",", "?"]


@dataclass(slots=True)
class Reply:
    """A 200's content, from either client."""

    texts: dict[int, str] = field(default_factory=dict)
    reasons: dict[int, str | None] = field(default_factory=dict)
    usage: dict | None = None
    done: bool = True  # a raw stream ended with `data: [DONE]`


@dataclass(slots=True)
class Draw:
    chat: bool
    payload: dict
    expected: tuple[str, str] | None = None  # (text, finish reason) of a greedy reference request
    exact_tokens: bool = False  # EOS ignored, no stop: every choice runs to max_tokens

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


def draw_valid(rng: random.Random, target: Target, chat: bool) -> Draw:
    n = rng.choice((1, 1, 1, 2, 3, 4))
    payload: dict = {"model": target.model, "n": n, "stream": rng.random() < 0.5}
    refs = [r for r in target.references if r.chat == chat]
    expected = None
    if refs and rng.random() < 0.5:
        ref = rng.choice(refs)
        payload.update(prompt_fields(chat, ref.prompt, parts=chat and rng.random() < 0.3),
                       max_tokens=ref.max_tokens, temperature=0.0)
        if rng.random() < 0.3:
            payload["seed"] = rng.randrange(1 << 31)  # changes nothing when greedy
        expected = ref.expected(None)
        if rng.random() < 0.4 and (stop := ref.stop_string(rng)) is not None:
            payload["stop"] = stop if rng.random() < 0.5 else [stop, "§never§"]
            expected = ref.expected(stop)
    else:
        prompt = rng.choice(CHAT_PROMPTS if chat else COMPLETION_PROMPTS)
        payload.update(prompt_fields(chat, prompt), max_tokens=rng.randint(1, 24),
                       temperature=rng.choice((0.0, 0.6, 1.0, 1.5)))
        if rng.random() < 0.5:
            payload["seed"] = rng.randrange(1 << 31)
        if rng.random() < 0.3:
            payload["top_p"] = rng.choice((0.5, 0.9))
        if rng.random() < 0.3:
            payload["stop"] = rng.sample(COMMON_STOPS, rng.randint(1, 4))
    if chat and rng.random() < 0.3:
        payload["max_completion_tokens"] = payload.pop("max_tokens")
    if payload["stream"] and rng.random() < 0.5:
        payload["stream_options"] = {"include_usage": True}
    return Draw(chat, payload, expected)


def draw_costly(rng: random.Random, target: Target) -> Draw:
    """Valid but expensive: sixteen choices, or a long prompt; EOS ignored, so each runs to its end."""
    payload: dict = {"model": target.model, "temperature": 1.0, "ignore_eos": True, "stream": rng.random() < 0.5,
                     "seed": rng.randrange(1 << 31)}
    if rng.random() < 0.5:
        payload.update(prompt=rng.choice(COMPLETION_PROMPTS), n=16, max_tokens=min(96, target.max_model_len // 4))
    else:
        length = min(2048, target.max_model_len // 2)
        payload.update(prompt=[rng.randrange(10, target.vocab_size) for _ in range(length)], n=rng.choice((1, 2)),
                       max_tokens=min(128, target.max_model_len - length - 1))
    if payload["stream"]:
        payload["stream_options"] = {"include_usage": True}
    return Draw(False, payload, exact_tokens=True)


def check(reply: Reply, draw: Draw) -> str | None:
    """Why the answer is wrong, or None."""
    p = draw.payload
    n, max_tokens = p.get("n", 1), p.get("max_tokens") or p.get("max_completion_tokens")
    if sorted(reply.texts) != list(range(n)):
        return f"choices {sorted(reply.texts)} for n={n}"
    if not reply.done:
        return "the stream ended without data: [DONE]"
    if any(reply.reasons.get(i) not in ("stop", "length") for i in range(n)):
        return f"finish reasons {reply.reasons}"
    if reply.usage is not None and not 0 < reply.usage.get("completion_tokens", -1) <= n * max_tokens:
        return f"usage {reply.usage} for n={n}, max_tokens={max_tokens}"
    if draw.exact_tokens:
        if any(r != "length" for r in reply.reasons.values()):
            return f"EOS ignored, yet finish reasons {reply.reasons}"
        if reply.usage is not None and reply.usage.get("completion_tokens") != n * max_tokens:
            return f"EOS ignored, yet usage {reply.usage} for n={n}, max_tokens={max_tokens}"
    if draw.expected is not None:
        text, reason = draw.expected
        wrong = {i: t for i, t in reply.texts.items() if t != text or reply.reasons[i] != reason}
        if wrong:
            return f"greedy answer differs from the reference: expected {text!r} ({reason}), got " + ", ".join(
                f"[{i}] {t!r} ({reply.reasons[i]})" for i, t in sorted(wrong.items())[:2])
    return None


def send_httpx(s: SoakClient, draw: Draw) -> Reply | Outcome:
    deadline = time.monotonic() + s.target.timeout_s
    if not draw.payload.get("stream"):
        r = s.http.post(draw.path, json=draw.payload)
        if r.status_code != 200:
            return classify_response(r.status_code, dict(r.headers), r.content, SERVED)
        body = r.json()
        reply = Reply(usage=body.get("usage"))
        for c in body["choices"]:
            reply.texts[c["index"]] = c["message"]["content"] if draw.chat else c["text"]
            reply.reasons[c["index"]] = c["finish_reason"]
        return reply
    with s.http.stream("POST", draw.path, json=draw.payload) as r:
        if r.status_code != 200:
            return classify_response(r.status_code, dict(r.headers), r.read(), SERVED)
        reply = Reply(done=False)
        for line in r.iter_lines():
            if time.monotonic() > deadline:
                raise TimeoutError("the stream went on past the action's deadline")
            if not line.startswith("data: "):
                continue  # blank separators and keep-alive comments
            if line == "data: [DONE]":
                reply.done = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Outcome("error event", "an error event in a 200 stream", {"event": chunk})
            reply.usage = chunk.get("usage") or reply.usage
            for c in chunk["choices"]:
                i = c["index"]
                piece = (c["delta"].get("content") or "") if draw.chat else c["text"]
                reply.texts[i] = reply.texts.get(i, "") + piece
                reply.reasons[i] = c.get("finish_reason") or reply.reasons.get(i)
        return reply


def send_openai(s: SoakClient, draw: Draw) -> Reply | Outcome:
    import openai

    p = dict(draw.payload)
    extra = {k: p.pop(k) for k in ("ignore_eos",) if k in p}
    create = s.openai.chat.completions.create if draw.chat else s.openai.completions.create
    deadline = time.monotonic() + s.target.timeout_s
    try:
        result = create(**p, extra_body=extra or None)
        if not p.get("stream"):
            reply = Reply(usage=result.usage.model_dump() if result.usage else None)
            for c in result.choices:
                reply.texts[c.index] = c.message.content if draw.chat else c.text
                reply.reasons[c.index] = c.finish_reason
            return reply
        reply = Reply()
        for chunk in result:
            if time.monotonic() > deadline:
                result.close()
                raise TimeoutError("the stream went on past the action's deadline")
            if chunk.usage:
                reply.usage = chunk.usage.model_dump()
            for c in chunk.choices:
                piece = (c.delta.content or "") if draw.chat else c.text
                reply.texts[c.index] = reply.texts.get(c.index, "") + piece
                reply.reasons[c.index] = c.finish_reason or reply.reasons.get(c.index)
        return reply
    except openai.APIStatusError as e:
        return classify_response(e.status_code, {k.lower(): v for k, v in e.response.headers.items()},
                                 _error_body(e), SERVED)
    except (openai.APITimeoutError, openai.APIConnectionError):
        raise  # the ledger judges these as hangs and closed connections
    except openai.APIError as e:  # an error event inside a 200 stream
        return Outcome("error event", "an error event in a 200 stream", {"event": str(e)[:300]})


def _error_body(e) -> bytes:
    try:
        return e.response.content
    except Exception:  # noqa: BLE001 - a streamed error response the client did not read
        return json.dumps({"error": e.body}).encode()


def valid(s: SoakClient, chat: bool, via: str, draw: Draw | None = None, action: str | None = None) -> None:
    draw = draw or draw_valid(s.rng, s.target, chat)
    action = action or f"valid.{'chat' if chat else 'completion'}.{via}"
    summary = {k: v for k, v in draw.payload.items() if k not in ("prompt", "model")}
    summary["prompt"] = str(draw.payload.get("prompt", ""))[:80]
    with s.ledger.request(action, SERVED, **summary) as slot:
        got = send_openai(s, draw) if via == "openai" else send_httpx(s, draw)
        if isinstance(got, Outcome):
            slot.outcome = got
            return
        why = check(got, draw)
        slot.outcome = Outcome("200") if why is None else Outcome("wrong answer", why, {
            "texts": got.texts, "finish_reasons": got.reasons, "usage": got.usage, "expected": draw.expected})


def costly(s: SoakClient) -> None:
    valid(s, False, "httpx", draw_costly(s.rng, s.target), "valid.costly")
