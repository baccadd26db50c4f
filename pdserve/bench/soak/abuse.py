"""The soak's abusive traffic: clients that leave, stall or crowd in. What each may get back:

- `disconnect_mid_stream`, `abandon_non_stream`: the client goes away; "abandoned" (or the answer,
  if it came first). The server must stop the work: the audit finds no KV held afterwards.
- `stalled_reader`: a stream whose client never reads (a 4 KiB receive buffer); after a hold the
  stream is found finished ("completed"), ended by the server ("closed") or still open
  ("abandoned", then closed by the client).
- `slowloris`: a request head a byte a second; the server must close the connection (or answer
  408) well before the head is complete.
- `slow_body`: a body in pieces a second apart, within the router's deadlines: a normal answer.
- `stalled_body`: half a body, then silence: 408, or the connection closed.
- `burst`: more requests at once than the router's queue holds, each read to its end like a real
  client: answers, and some 429 (with Retry-After).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from urllib.parse import urlsplit

from pdserve.bench.soak import raw_http as raw
from pdserve.bench.soak.outcomes import SERVED, Expect, Outcome, classify_response
from pdserve.bench.soak.target import COMPLETION_PROMPTS, SoakClient

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
STALLED_RCVBUF = 4096
SLOW_HEAD_LIMIT_S = 60.0  # a slowloris head still open after this counts as a hang
STALLED_BODY_LIMIT_S = 45.0  # the router's body deadlines (10 s of silence, 30 s in all) and a margin


def _long_stream(s: SoakClient, chat: bool) -> dict:
    rng, t = s.rng, s.target
    prompt = rng.choice(COMPLETION_PROMPTS)
    fields = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    return {"model": t.model, **fields, "max_tokens": min(rng.randint(64, 256), t.max_model_len // 4),
            "ignore_eos": True, "n": rng.choice((1, 2, 4)), "stream": True, "temperature": 0.8}


def disconnect_mid_stream(s: SoakClient) -> None:
    chat = s.rng.random() < 0.5
    payload = _long_stream(s, chat)
    events_wanted = s.rng.randint(1, 5) + chat  # chat's first event is only the role
    with s.ledger.request("abuse.disconnect_mid_stream", SERVED, n=payload["n"], max_tokens=payload["max_tokens"],
                          after_events=events_wanted) as slot:
        deadline = time.monotonic() + s.target.timeout_s
        # leaving the block before the body is read closes the connection (it cannot be reused)
        with s.http.stream("POST", CHAT if chat else COMPLETIONS, json=payload) as r:
            if r.status_code != 200:
                slot.outcome = classify_response(r.status_code, dict(r.headers), r.read(), SERVED)
                return
            events = 0
            for line in r.iter_lines():
                if time.monotonic() > deadline:
                    raise TimeoutError("no events before the action's deadline")
                if line == "data: [DONE]":
                    slot.outcome = Outcome("200")  # all of it came before the client left
                    return
                if line.startswith("data: "):
                    if '"error"' in line and "error" in json.loads(line[6:]):
                        slot.outcome = Outcome("error event", "an error event in a 200 stream", {"event": line})
                        return
                    events += 1
                    if events >= events_wanted:
                        break
        slot.outcome = Outcome("abandoned")


def abandon_non_stream(s: SoakClient) -> None:
    payload = {**_long_stream(s, False), "stream": False}
    wait_s = s.rng.uniform(0.2, 3.0)
    with s.ledger.request("abuse.abandon_non_stream", SERVED, n=payload["n"], max_tokens=payload["max_tokens"],
                          wait_s=round(wait_s, 2)) as slot:
        sock = raw.connect(s.target.url, s.target.timeout_s)
        try:
            sock.sendall(raw.json_request(COMPLETIONS, raw.dumps(payload), s.target.api_key))
            data, closed = raw.drain(sock, wait_s)
            if not data:
                slot.outcome = Outcome("closed", "the server closed the connection") if closed else Outcome("abandoned")
                return
            status, headers, body = raw.parse_response(data + raw.drain(sock, 5.0)[0])
            slot.outcome = classify_response(status, headers, body, SERVED)
        finally:
            sock.close()


def stalled_reader(s: SoakClient) -> None:
    payload = {**_long_stream(s, False), "n": 4, "max_tokens": min(512, s.target.max_model_len // 2)}
    hold_s = s.target.stall_hold_s
    with s.ledger.request("abuse.stalled_reader", SERVED, hold_s=hold_s, max_tokens=payload["max_tokens"]) as slot:
        sock = raw.connect(s.target.url, s.target.timeout_s, rcvbuf=STALLED_RCVBUF)
        deadline = time.monotonic() + s.target.timeout_s
        try:
            sock.sendall(raw.json_request(COMPLETIONS, raw.dumps(payload), s.target.api_key))
            time.sleep(hold_s)  # never reading: the server's writes back up
            data, closed = raw.drain(sock, 3.0)
            while raw.status_of(data) is None and not closed and time.monotonic() < deadline:  # a busy server
                more, closed = raw.drain(sock, 1.0)
                data += more
        finally:
            sock.close()
        status = raw.status_of(data)
        if status is None:
            slot.outcome = Outcome("hang", f"no response head within {s.target.timeout_s:g} s", {"closed": closed})
        elif status != 200:
            slot.outcome = classify_response(*raw.parse_response(data), SERVED)
        elif b"data: [DONE]" in data:
            slot.outcome = Outcome("completed")
        else:
            slot.outcome = Outcome("closed" if closed else "abandoned")


def slowloris(s: SoakClient) -> None:
    expect = Expect.of(408, closed_ok=True)
    data = raw.head(COMPLETIONS, "Content-Type: application/json", "X-Padding: " + "a" * 200)
    with s.ledger.request("abuse.slowloris", expect) as slot:
        sock = raw.connect(s.target.url, SLOW_HEAD_LIMIT_S)
        start = time.monotonic()
        try:
            sent, spoke = raw.trickle(sock, data, 1.0, start + SLOW_HEAD_LIMIT_S)
            slot.what.update(bytes_sent=sent, seconds=round(time.monotonic() - start, 1))
            if not spoke:
                slot.outcome = Outcome("hang", f"the server kept a head trickled a byte a second open for "
                                               f"{time.monotonic() - start:.0f} s", {"bytes_sent": sent})
                return
            answer, closed = raw.drain(sock, 5.0)
        finally:
            sock.close()
        if raw.status_of(answer) is not None:
            slot.outcome = classify_response(*raw.parse_response(answer), expect)
        else:
            slot.outcome = Outcome("closed")


def slow_body(s: SoakClient) -> None:
    body = raw.dumps({"model": s.target.model, "prompt": s.rng.choice(COMPLETION_PROMPTS), "max_tokens": 8})
    pieces = s.rng.randint(3, 6)
    gap_s = s.rng.uniform(0.5, 1.5)
    with s.ledger.request("abuse.slow_body", SERVED, pieces=pieces, gap_s=round(gap_s, 2)) as slot:
        sock = raw.connect(s.target.url, s.target.timeout_s)
        try:
            sock.sendall(raw.head(COMPLETIONS, "Content-Type: application/json",
                                  f"Authorization: Bearer {s.target.api_key}", f"Content-Length: {len(body)}"))
            step = -(-len(body) // pieces)
            for i in range(0, len(body), step):
                time.sleep(gap_s)
                sock.sendall(body[i:i + step])
            status, headers, answer = raw.read_response(sock)
        finally:
            sock.close()
        slot.outcome = classify_response(status, headers, answer, SERVED)
        if status == 200 and len(json.loads(answer).get("choices", [])) != 1:
            slot.outcome = Outcome("wrong answer", "not one choice", {"body": answer[:300].decode("utf-8", "replace")})


def stalled_body(s: SoakClient) -> None:
    expect = Expect.of(408, closed_ok=True)
    body = raw.dumps({"model": s.target.model, "prompt": "hi", "max_tokens": 4})
    with s.ledger.request("abuse.stalled_body", expect, sent_of=f"{len(body) // 2}/{len(body)}") as slot:
        sock = raw.connect(s.target.url, STALLED_BODY_LIMIT_S)
        try:
            sock.sendall(raw.json_request(COMPLETIONS, body, s.target.api_key)[:-(len(body) - len(body) // 2)])
            slot.outcome = classify_response(*raw.read_response(sock), expect)
        finally:
            sock.close()


def burst(s: SoakClient) -> None:
    """`burst_size` streamed requests at once, each read to its end."""
    t = s.target
    with t.burst_lock:
        t.burst_running, t.last_burst = True, time.monotonic()
    start = time.monotonic()
    try:
        outcomes = asyncio.run(_burst(s))
    finally:
        with t.burst_lock:
            t.burst_running = False
    s.ledger.note("burst", {"at_s": round(start - s.ledger.t0, 1), "sent": t.burst_size,
                            "seconds": round(time.monotonic() - start, 1), "outcomes": dict(outcomes)})


async def _burst(s: SoakClient) -> Counter[str]:
    t = s.target
    parts = urlsplit(t.url)
    outcomes: Counter[str] = Counter()
    ready = asyncio.Event()  # every connection is open: all requests go out together
    opened = [0]

    async def one(i: int) -> None:
        ids = [s.rng.randrange(10, t.vocab_size) for _ in range(8 + i % 24)]
        payload = {"model": t.model, "prompt": ids, "max_tokens": t.burst_max_tokens, "ignore_eos": True,
                   "stream": True, "temperature": 0.0}
        with s.ledger.request("abuse.burst", SERVED, index=i) as slot:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, parts.port),
                                                        t.timeout_s)
            finally:
                opened[0] += 1
                if opened[0] == t.burst_size:
                    ready.set()
            try:
                await ready.wait()
                writer.write(raw.json_request(COMPLETIONS, raw.dumps(payload), t.api_key))
                async with asyncio.timeout(t.timeout_s):
                    slot.outcome = await _read_burst_answer(reader, payload["max_tokens"])
            finally:
                writer.close()
        outcomes[slot.outcome.label if slot.outcome else "unjudged"] += 1

    await asyncio.gather(*(one(i) for i in range(t.burst_size)))
    return outcomes


async def _read_burst_answer(reader: asyncio.StreamReader, max_tokens: int) -> Outcome:
    head = await reader.readuntil(b"\r\n\r\n")
    status, headers, _ = raw.parse_response(head)
    if "chunked" in headers.get("transfer-encoding", ""):
        body = bytearray()
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readuntil(b"\r\n")
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    if status != 200:
        return classify_response(status, headers, bytes(body), SERVED)
    events = [line[6:] for line in bytes(body).decode().split("\n") if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return Outcome("wrong answer", "the stream ended without data: [DONE]", {"tail": events[-3:]})
    chunks = [json.loads(e) for e in events[:-1]]
    if errors := [c for c in chunks if "error" in c]:
        return Outcome("error event", "an error event in a 200 stream", {"event": errors[0]})
    reasons = [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c.get("finish_reason")]
    if reasons != ["length"]:
        return Outcome("wrong answer", f"EOS ignored and max_tokens {max_tokens}, yet finish reasons {reasons}")
    return Outcome("200")
