"""The soak's malformed traffic: requests the router must refuse with the right status, in the
OpenAI error shape, without harm to anything else.

- 400: bad JSON, wrong types, out-of-range numbers, lone surrogates (raw `\\ud800` escapes: valid
  JSON, invalid Unicode), more than 4 stop strings, lying framing (Content-Length together with a
  chunked body; a Content-Length shorter than the body);
- 401: a wrong or missing API key; 404: a model the router does not serve;
- 413: a body over the router's 8 MiB limit, declared up front or streamed chunked.
"""

from __future__ import annotations

import json

from pdserve.bench.soak import raw_http as raw
from pdserve.bench.soak.outcomes import Expect, classify_response
from pdserve.bench.soak.target import SoakClient

BODY_LIMIT = 8 << 20  # the router's (RouterConfig.max_body_bytes)
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def _base(s: SoakClient, chat: bool) -> dict:
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    return {"model": s.target.model, "max_tokens": 4, **prompt}


def _send(s: SoakClient, action: str, variant: str, path: str, body: bytes, expect: Expect) -> None:
    shown = body[:300].decode("utf-8", "replace")
    with s.ledger.request(action, expect, variant=variant, path=path, body=shown) as slot:
        r = s.http.post(path, content=body, headers={"Content-Type": "application/json"})
        slot.outcome = classify_response(r.status_code, dict(r.headers), r.content, expect)


def _exchange(s: SoakClient, action: str, variant: str, data: bytes, expect: Expect, shown: bytes = b"") -> None:
    """`data` as one raw request on a fresh connection; the first answer judged."""
    sent = (shown or data)[:300].decode("utf-8", "replace")
    with s.ledger.request(action, expect, variant=variant, sent=sent) as slot:
        sock = raw.connect(s.target.url, s.target.timeout_s)
        try:
            sock.sendall(data)
            slot.outcome = classify_response(*raw.read_response(sock), expect)
        finally:
            sock.close()


def bad_json(s: SoakClient) -> None:
    m = json.dumps(s.target.model).encode()
    variants = {
        "truncated": b'{"model": ' + m + b', "prompt": "hi"',
        "not json": b"not json at all",
        "trailing comma": b'{"model": ' + m + b', "prompt": "hi",}',
        "empty": b"",
        "array": b"[1, 2, 3]",
        "invalid utf-8": b'{"model": ' + m + b', "prompt": "\xff\xfe"}',
        "trailing garbage": b'{"model": ' + m + b', "prompt": "hi"} and more',
    }
    name = s.rng.choice(sorted(variants))
    _send(s, "malformed.bad_json", name, s.rng.choice((COMPLETIONS, CHAT)), variants[name], Expect.of(400))


WRONG_TYPES = [
    (False, {"max_tokens": "16"}), (False, {"n": 1.5}), (False, {"n": "2"}), (False, {"temperature": "hot"}),
    (False, {"prompt": 123}), (False, {"prompt": [[1, 2]]}), (False, {"prompt": [1.5]}), (False, {"stop": 5}),
    (False, {"stream": "maybe"}), (False, {"top_k": 1.0}), (False, {"seed": "7"}), (False, {"model": 42}),
    (False, {"stream_options": "yes"}), (True, {"messages": "hello"}),
    (True, {"messages": [{"role": "wizard", "content": "x"}]}), (True, {"messages": [{"role": "user", "content": 5}]}),
    (True, {"messages": [{"content": "no role"}]}),
    (True, {"messages": [{"role": "user", "content": [{"type": "image"}]}]}),
]


def wrong_type(s: SoakClient) -> None:
    chat, change = s.rng.choice(WRONG_TYPES)
    body = {**_base(s, chat), **change}
    _send(s, "malformed.wrong_type", json.dumps(change), CHAT if chat else COMPLETIONS, json.dumps(body).encode(),
          Expect.of(400))


def out_of_range(s: SoakClient) -> None:
    t = s.target
    variants: list[tuple[bool, dict | str]] = [
        (False, {"temperature": 2.5}), (False, {"temperature": -0.5}), (False, {"top_p": 0}), (False, {"top_p": 1.5}),
        (False, {"n": 0}), (False, {"n": 17}), (False, {"max_tokens": 0}), (False, {"max_tokens": -1}),
        (False, {"max_tokens": 1 << 40}), (False, {"max_tokens": t.max_model_len}), (False, {"top_k": -2}),
        (False, {"seed": -1}), (False, {"min_p": 1.5}), (False, {"priority": 10}), (False, {"logprobs": 5}),
        (False, {"echo": True}), (False, {"prompt": [t.vocab_size]}), (False, {"prompt": [-1]}),
        (False, {"prompt": [1 << 31]}), (False, {"prompt": []}), (True, {"max_completion_tokens": 0}),
        (True, {"messages": []}), (False, '"temperature": 1e400'), (False, '"top_p": NaN'),
    ]
    chat, change = s.rng.choice(variants)
    if isinstance(change, str):  # not expressible as a Python dict: spliced into the JSON text
        body = json.dumps(_base(s, chat))[:-1] + ", " + change + "}"
    else:
        body = json.dumps({**_base(s, chat), **change})
    _send(s, "malformed.out_of_range", str(change), CHAT if chat else COMPLETIONS, body.encode(), Expect.of(400))


def lone_surrogate(s: SoakClient) -> None:
    m = json.dumps(s.target.model)
    variants = {  # raw text: the escapes reach the server as written
        "prompt": (COMPLETIONS, '{"model": %s, "prompt": "abc\\ud800def"}' % m),
        "low surrogate": (COMPLETIONS, '{"model": %s, "prompt": "\\udc00"}' % m),
        "chat content": (CHAT, '{"model": %s, "messages": [{"role": "user", "content": "hi \\udfff"}]}' % m),
        "content part": (CHAT, '{"model": %s, "messages": [{"role": "user", "content": '
                               '[{"type": "text", "text": "\\ud83d"}]}]}' % m),
        "stop": (COMPLETIONS, '{"model": %s, "prompt": "hi", "stop": ["\\ud83d"]}' % m),
    }
    name = s.rng.choice(sorted(variants))
    path, body = variants[name]
    _send(s, "malformed.lone_surrogate", name, path, body.encode(), Expect.of(400))


def too_many_stops(s: SoakClient) -> None:
    variants = {"5 stops": [".", ",", "!", "?", ";"], "8 stops": [str(i) for i in range(8)],
                "257 chars": ["x" * 257], "empty": [""], "not a string": [".", 3]}
    name = s.rng.choice(sorted(variants))
    body = {**_base(s, s.rng.random() < 0.5), "stop": variants[name]}
    _send(s, "malformed.too_many_stops", name, CHAT if "messages" in body else COMPLETIONS,
          json.dumps(body).encode(), Expect.of(400))


def unknown_model(s: SoakClient) -> None:
    name, status = s.rng.choice([("gpt-4", 404), ("", 404), (s.target.model + "-x", 404), ("x" * 300, 400)])
    chat = s.rng.random() < 0.5
    body = {**_base(s, chat), "model": name}
    _send(s, "malformed.unknown_model", name[:40], CHAT if chat else COMPLETIONS, json.dumps(body).encode(),
          Expect.of(status))


def _key_request(s: SoakClient, authorization: str | None) -> tuple[str, bytes]:
    path = s.rng.choice((COMPLETIONS, CHAT, "/v1/models"))
    auth = [f"Authorization: {authorization}"] if authorization is not None else []
    if path == "/v1/models":
        return path, raw.head(path, *auth, method="GET")
    body = json.dumps(_base(s, path == CHAT)).encode()
    return path, raw.head(path, "Content-Type: application/json", f"Content-Length: {len(body)}", *auth) + body


def wrong_key(s: SoakClient) -> None:
    key = s.target.api_key
    name, value = s.rng.choice([("wrong", "Bearer not-the-key"), ("longer", f"Bearer {key}x"),
                                ("shorter", f"Bearer {key[:-1]}"), ("no scheme", key), ("basic", f"Basic {key}")])
    path, data = _key_request(s, value)
    shown = data.replace(key.encode(), b"<key>")  # the key stays out of the report
    _exchange(s, "malformed.wrong_key", f"{name} {path}", data, Expect.of(401), shown=shown)


def missing_key(s: SoakClient) -> None:
    path, data = _key_request(s, s.rng.choice((None, "Bearer ", "")))
    _exchange(s, "malformed.missing_key", path, data, Expect.of(401))


def _big_body(s: SoakClient) -> bytes:
    return json.dumps(_base(s, False))[:-1].encode() + b', "pad": "' + b"a" * (BODY_LIMIT + 1) + b'"}'


def oversized_body(s: SoakClient) -> None:
    """Declared: refused from the head; the server drains the rest, so the client reads its 413."""
    body = _big_body(s)
    data = raw.json_request(COMPLETIONS, body, s.target.api_key)
    _exchange(s, "malformed.oversized_body", f"Content-Length {len(body)}", data, Expect.of(413), shown=data[:200])


def oversized_chunked(s: SoakClient) -> None:
    """Undeclared: refused once the bytes that arrived pass the limit."""
    body = raw.chunked(_big_body(s), 64 << 10)
    data = raw.head(COMPLETIONS, "Content-Type: application/json", f"Authorization: Bearer {s.target.api_key}",
                    "Transfer-Encoding: chunked") + body
    _exchange(s, "malformed.oversized_chunked", f"chunked {len(body)} bytes", data, Expect.of(413), shown=data[:200])


def cl_and_te(s: SoakClient) -> None:
    """A small Content-Length and a bigger chunked body: the two framings disagree (smuggling)."""
    body = json.dumps(_base(s, False)).encode()
    data = raw.head(COMPLETIONS, "Content-Type: application/json", f"Authorization: Bearer {s.target.api_key}",
                    "Content-Length: 5", "Transfer-Encoding: chunked") + raw.chunked(body, 16)
    _exchange(s, "malformed.cl_and_te", "Content-Length 5 + chunked", data, Expect.of(400))


def cl_too_small(s: SoakClient) -> None:
    """The body runs past its Content-Length: the first bytes are the request (bad JSON); the rest
    would be the next request on the connection, which is closed after the first answer."""
    body = json.dumps(_base(s, False)).encode()
    data = raw.head(COMPLETIONS, "Content-Type: application/json", f"Authorization: Bearer {s.target.api_key}",
                    "Content-Length: 12") + body
    _exchange(s, "malformed.cl_too_small", f"Content-Length 12 of {len(body)}", data, Expect.of(400))

