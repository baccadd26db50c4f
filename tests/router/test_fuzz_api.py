"""Property-based fuzz of the router's HTTP edges, against a real cluster in this process (router,
one prefill and one decode worker, an API key and a worker token).

The rule: whatever a client sends, the router answers 2xx or a 4xx in the OpenAI error shape,
never a 5xx and never nothing; a streamed 200 ends with `data: [DONE]`, every event before it
JSON (an error inside the stream in the same shape); afterwards a known-good request still gets
its greedy text, and once each example is over no worker holds a request, a lease or a KV block.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.router.policy import DisaggregationPolicy
from tests.openai_shape import assert_openai_error, bearer, note
from tests.penalty_strategies import penalty_fields
from tests.router_server import MODEL, RouterServer
from tests.wait import wait_for
from tests.worker.cluster import Cluster

API_KEY = "sk-fuzz-key"
TOKEN = "fuzz-worker-token"
TIMEOUT_S = 30.0  # no answer within this is a hang, and a failure
KNOWN_GOOD = {"model": MODEL, "prompt": "the quick brown fox jumps over the lazy dog", "max_tokens": 4,
              "temperature": 0}


def fuzz(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])


# -- the cluster ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tiny_llama):
    policy = DisaggregationPolicy(min_remote_tokens=8)
    # a connection per request: a server that drops one after an answer cannot fail the next example
    no_reuse = httpx.Limits(max_keepalive_connections=0)
    with (Cluster(tiny_llama, "tcp", token=TOKEN) as pair,
          RouterServer(tiny_llama, api_key=API_KEY, worker_token=TOKEN, disaggregation=policy) as rs,
          httpx.Client(base_url=rs.url, timeout=TIMEOUT_S, limits=no_reuse) as client):
        rs.join(pair.p)
        rs.join(pair.d)
        r = client.post("/v1/completions", json=KNOWN_GOOD, headers=bearer(API_KEY))
        assert r.status_code == 200, r.text
        yield {"router": rs.router, "p": pair.p, "d": pair.d, "client": client,
               "model_hash": rs.router.registry.model_hash, "reference": r.json()["choices"][0]["text"]}


def send(cluster, method: str, path: str, content: bytes | None = None, headers: dict | None = None) -> tuple:
    """(status, parsed JSON body or None, SSE events or None); fails on a 5xx, a malformed answer or
    no answer within TIMEOUT_S."""
    headers = {"content-type": "application/json", **(headers or {})}
    try:
        with cluster["client"].stream(method, path, content=content, headers=headers) as r:
            if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
                note(f"{method} {path.split('?')[0]}: 200 (streamed)")
                return r.status_code, None, read_sse(r)
            raw = r.read()
    except httpx.TimeoutException as e:
        pytest.fail(f"{method} {path}: no answer within {TIMEOUT_S:.0f} s ({type(e).__name__})")
    status = r.status_code
    note(f"{method} {path.split('?')[0]}: {status}")
    assert status < 500, f"{method} {path} answered {status}: {raw[:2000]!r}"
    assert 200 <= status < 300 or 400 <= status < 500, f"{method} {path} answered {status}: {raw[:2000]!r}"
    if path == "/metrics" and status == 200:
        return status, raw.decode(), None
    try:
        payload = json.loads(raw)
    except ValueError:
        pytest.fail(f"{method} {path} answered {status} with a body that is not JSON: {raw[:2000]!r}")
    if status >= 400:
        assert_openai_error(payload, status)
    return status, payload, None


def read_sse(r: httpx.Response) -> list[dict]:
    """The JSON events of a streamed 200, which must end with `data: [DONE]` and nothing after."""
    events: list[dict] = []
    done = False
    for line in r.iter_lines():
        if not line or line.startswith(":"):  # event separators and keep-alive comments
            continue
        assert not done, f"an event after [DONE]: {line!r}"
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        assert isinstance(event, dict), event
        if "error" in event:
            assert_openai_error(event, event["error"].get("code"))
            assert event["error"]["code"] < 500, f"a server error inside the stream: {event}"
        events.append(event)
    assert done, f"the stream ended without [DONE] after {len(events)} events: {events[-3:]}"
    return events


def check_completion(body: object, status: int, payload: dict | None, events: list | None, chat: bool) -> None:
    """A 200's content agrees with what was asked: n choices, each ended for a reason OpenAI names."""
    if status != 200:
        return
    assert isinstance(body, dict)  # nothing else can have been accepted
    n = body.get("n", 1)
    if events is None:
        assert payload["object"] == ("chat.completion" if chat else "text_completion"), payload
        assert [c["index"] for c in payload["choices"]] == list(range(n)), payload
        for c in payload["choices"]:
            assert c["finish_reason"] in ("stop", "length"), c
            text = c["message"]["content"] if chat else c["text"]
            assert isinstance(text, str)
        u = payload["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["prompt_tokens"] > 0, u
        return
    kind = "chat.completion.chunk" if chat else "text_completion"
    finished: set[int] = set()
    for e in events:
        if "error" in e:
            continue
        assert e["object"] == kind and isinstance(e["choices"], list), e
        for c in e["choices"]:
            assert 0 <= c["index"] < n and c["finish_reason"] in (None, "stop", "length"), c
            if c["finish_reason"] is not None:
                finished.add(c["index"])
    if not any("error" in e for e in events):
        assert finished == set(range(n)), f"choices that never finished: {set(range(n)) - finished}"


def assert_still_serves(cluster) -> None:
    status, payload, _ = send(cluster, "POST", "/v1/completions", json.dumps(KNOWN_GOOD).encode(), bearer(API_KEY))
    assert status == 200, payload
    assert payload["choices"][0]["text"] == cluster["reference"]


def assert_nothing_leaks(cluster) -> None:
    router, p, d = cluster["router"], cluster["p"], cluster["d"]
    # aborts of requests whose clients left reach the workers within a second or two
    wait_for(lambda: p.is_idle() and d.is_idle() and router.admission.requests == 0 and not router.live, 15,
             "idle workers and router", state=lambda: (
                 f"prefill {p.worker.stats()}, decode {d.worker.stats()}, router holds {router.admission.requests} "
                 f"requests, {router.admission.tokens} tokens, {list(router.live)}"))
    assert router.admission.tokens == 0


def encode(body: object) -> bytes:
    # ensure_ascii writes lone surrogates as "\ud800" escapes; allow_nan writes NaN and Infinity,
    # which Python's parser (and so the server's) reads: both must be refused by validation
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


def one_in(n: int) -> st.SearchStrategy[bool]:
    """True about once in n draws (`st.integers(0, n - 1) == 0` would be true far more often:
    Hypothesis favours small integers)."""
    return st.sampled_from([False] * (n - 1) + [True])


# -- values -----------------------------------------------------------------------------------

EDGE_INTS = [0, -1, 1, 2, 8, 16, 17, 20, 255, 256, 511, 512, 1023, 1024, 1025, 2**24, 2**24 + 1, 2**31 - 1, 2**31,
             2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 1, -2**31, -2**63, -2**63 - 1, 10**30, 10**300]
SPECIAL_TEXT = ["", " ", "\u200b", "\u200d", "\u202e", "\u200f", "\ufeff", "\x00", "\x7f", "\n\r\t", "😀",
                "👩\u200d👩\u200d👧", "مرحبا بالعالم", "שלום", "\U0010ffff", "\ufffd", "<|eot_id|>", "<s>", "</s>",
                "{{ raise_exception('boom') }}", "{% for x in y %}", "\\", '"', "data: [DONE]\n\n"]
SURROGATE = st.characters(categories=["Cs"])

small_text = st.one_of(st.text(max_size=12), st.sampled_from(SPECIAL_TEXT))
unicode_text = st.one_of(  # valid Unicode: what a client may send
    st.text(max_size=40),
    st.sampled_from(SPECIAL_TEXT),
    st.lists(st.one_of(st.sampled_from(SPECIAL_TEXT), st.text(max_size=4)), max_size=6).map("".join),
)
prompt_text = st.one_of(
    st.text(min_size=1, max_size=40),
    st.sampled_from([t for t in SPECIAL_TEXT if t]),
    st.lists(st.one_of(st.sampled_from(SPECIAL_TEXT), st.text(max_size=4)), min_size=1, max_size=6).map(
        lambda parts: "".join(parts) or "x"),
)
surrogate_text = st.tuples(small_text, SURROGATE, st.lists(st.one_of(small_text, SURROGATE), max_size=3)).map(
    lambda t: t[0] + t[1] + "".join(t[2]))  # a lone surrogate, somewhere
long_text = st.sampled_from([300, 1500, 5000, 200_000]).map(lambda n: ("word " * n)[:n * 5])
any_text = st.one_of(unicode_text, surrogate_text, long_text)
numbers = st.one_of(st.sampled_from(EDGE_INTS), st.integers(), st.floats(), st.booleans())
scalars = st.one_of(st.none(), st.booleans(), numbers, small_text)
junk = st.one_of(  # nested a level or two (st.recursive discards many of its draws)
    scalars,
    st.lists(scalars, max_size=4),
    st.dictionaries(small_text, scalars, max_size=3),
    st.lists(st.one_of(st.lists(scalars, max_size=2), st.dictionaries(small_text, scalars, max_size=2)), max_size=2),
    st.dictionaries(small_text, st.lists(scalars, max_size=2), max_size=2),
)
hostile = st.one_of(numbers, junk, st.none(), small_text)

valid_stop = st.one_of(
    st.text(min_size=1, max_size=6),
    st.lists(st.text(min_size=1, max_size=6), max_size=4),
    st.none(),
)
hostile_stop = st.one_of(
    st.lists(st.one_of(st.text(max_size=300), surrogate_text, st.sampled_from(["", "s" * 256, "s" * 257])),
             max_size=20),
    st.sampled_from(["", "s" * 256, "s" * 257]),
    hostile,
)

# name -> (valid values, hostile values) of the sampling fields both routes share
SAMPLING_FIELDS = {
    "temperature": (st.floats(0, 2), st.one_of(st.floats(), hostile)),
    "top_p": (st.floats(0.01, 1), st.one_of(st.floats(), hostile)),
    "top_k": (st.integers(-1, 600), hostile),
    "min_p": (st.floats(0, 1), st.one_of(st.floats(), hostile)),
    "n": (st.integers(1, 4), st.one_of(st.integers(0, 20), hostile)),
    "seed": (st.integers(0, 2**63 - 1), hostile),
    "stop": (valid_stop, hostile_stop),
    "stream": (st.booleans(), hostile),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}),
                       st.one_of(st.fixed_dictionaries({"include_usage": hostile}), hostile)),
    "ignore_eos": (st.booleans(), hostile),
    "speculate": (st.booleans(), hostile),
    "min_tokens": (st.integers(0, 4), st.one_of(st.sampled_from([5, 8, 9, 2**24, 2**24 + 1]), hostile)),
    "priority": (st.integers(0, 9), hostile),
    "logprobs": (st.sampled_from([None, False, 0]), hostile),
    "user": (small_text, hostile),  # fields other clients send, ignored here
    **penalty_fields(hostile),
    "stop_token_ids": (st.lists(st.integers(0, 511), max_size=4),
                       st.one_of(st.lists(st.one_of(st.integers(), hostile), max_size=70), hostile)),
    "response_format": (st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
                        st.one_of(st.fixed_dictionaries({"type": st.one_of(small_text, hostile)}),
                                  st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": junk}),
                                  hostile)),
    "structured_outputs": (st.sampled_from([{"choice": ["a", "b"]}, {"regex": "[a-z]{1,3}"}]),
                           st.one_of(st.fixed_dictionaries({"regex": st.one_of(small_text, hostile)}),
                                     st.fixed_dictionaries({"grammar": st.one_of(small_text, hostile)}), hostile)),
}
small_max_tokens = st.integers(1, 8)
hostile_max_tokens = st.one_of(st.sampled_from(EDGE_INTS + [64, 1000]), st.floats(), st.booleans(), hostile)


def bounded(body: dict) -> dict:
    """A request the server may accept that asks for hundreds of tokens asks for one completion:
    hundreds of tokens times n are slow on a CPU, and prove nothing the single one does not."""
    limits = [body.get(k) for k in ("max_tokens", "max_completion_tokens")]
    small = [v for v in limits if type(v) is int and v <= 8]
    if not small and type(body.get("n")) is int and body["n"] > 1:
        body["n"] = 1
    return body


@st.composite
def mutated(draw, base: dict, hostile_fields: dict, spoiled=st.sampled_from([0, 0, 1, 1, 1, 2, 3])) -> dict:
    """`base` (valid) with up to three fields made hostile, removed or null, and maybe extra ones;
    by default a third of the bodies are valid as they come."""
    body = dict(base)
    how_many = min(draw(spoiled), len(hostile_fields))
    for name in draw(st.lists(st.sampled_from(sorted(hostile_fields)), min_size=how_many, max_size=how_many,
                              unique=True)):
        action = draw(st.sampled_from(["hostile", "hostile", "delete", "null"]))
        if action == "hostile":
            body[name] = draw(hostile_fields[name])
        elif action == "delete":
            body.pop(name, None)
        else:
            body[name] = None
    if draw(one_in(4)):
        body.update(draw(st.dictionaries(st.sampled_from(["extra", "tools", "functions", "suffix", "best_of",
                                                          "__proto__", "😀", ""]), junk, min_size=1, max_size=2)))
    return bounded(body)


def optional_sampling(draw) -> dict:
    return draw(st.fixed_dictionaries({}, optional={k: valid for k, (valid, _) in SAMPLING_FIELDS.items()}))


def sampling_hostility() -> dict:
    return {k: bad for k, (_, bad) in SAMPLING_FIELDS.items()}


token_ids = st.lists(st.integers(0, 511), min_size=1, max_size=24)
hostile_token_ids = st.one_of(
    st.lists(st.one_of(st.sampled_from(EDGE_INTS), st.integers(), st.floats(), st.booleans(), small_text),
             max_size=12),
    st.sampled_from([[], [[1, 2]], [["a"]], [5] * 1100, list(range(512, 520))]),
)


@st.composite
def completion_bodies(draw) -> dict:
    base = {"model": MODEL, "prompt": draw(st.one_of(prompt_text, token_ids)), "max_tokens": draw(small_max_tokens),
            "stream": draw(st.booleans()), **optional_sampling(draw)}
    hostile_fields = {**sampling_hostility(),
                      "model": st.one_of(small_text, st.just(MODEL * 100), hostile),
                      "prompt": st.one_of(any_text, hostile_token_ids, st.lists(small_text, max_size=3), hostile),
                      "max_tokens": hostile_max_tokens,
                      "echo": st.one_of(st.booleans(), hostile)}
    return draw(mutated(base, hostile_fields))


ROLES = ["system", "user", "assistant", "developer", "tool"]
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": unicode_text})
hostile_part = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "", "TEXT"]), "text": unicode_text}),
    st.fixed_dictionaries({"type": st.just("text"), "text": hostile}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": small_text})}),
    st.fixed_dictionaries({"text": unicode_text}),
    junk,
)
valid_content = st.one_of(unicode_text, st.none(), st.lists(text_part, max_size=3))
hostile_content = st.one_of(any_text, st.lists(st.one_of(text_part, hostile_part, st.fixed_dictionaries(
    {"type": st.just("text"), "text": surrogate_text})), max_size=4), hostile)


@st.composite
def messages(draw) -> list:
    out = []
    count = draw(st.integers(1, 4))
    odd = draw(st.sampled_from([None, None, None] + list(range(count))))  # which message, if any, is odd
    for i in range(count):
        m = {"role": draw(st.sampled_from(ROLES)), "content": draw(valid_content)}
        if i == odd:
            kind = draw(st.sampled_from(["role", "content", "both", "missing", "extra", "not a dict"]))
            if kind in ("role", "both"):
                m["role"] = draw(st.one_of(st.sampled_from(["wizard", "", "USER", "function", "assistant "]), hostile))
            if kind in ("content", "both"):
                m["content"] = draw(hostile_content)
            if kind == "missing":
                m.pop(draw(st.sampled_from(["role", "content"])))
            if kind == "extra":
                m.update(draw(st.dictionaries(st.sampled_from(["name", "tool_calls", "tool_call_id", "refusal"]), junk,
                                              min_size=1, max_size=2)))
            if kind == "not a dict":
                m = draw(hostile)
        out.append(m)
    return out


hostile_messages = st.one_of(
    st.just([]),
    hostile,
    st.sampled_from([4097, 5000]).map(lambda n: [{"role": "user", "content": "x"}] * n),
    st.just([{"role": "user", "content": "word " * 2000}]),
    st.lists(st.one_of(junk, hostile_part), min_size=1, max_size=3),
)


@st.composite
def chat_bodies(draw) -> dict:
    limit = draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))
    base = {"model": MODEL, "messages": draw(messages()), limit: draw(small_max_tokens), "stream": draw(st.booleans()),
            **optional_sampling(draw)}
    hostile_fields = {**sampling_hostility(),
                      "model": st.one_of(small_text, hostile),
                      "messages": hostile_messages,
                      "max_tokens": hostile_max_tokens,
                      "max_completion_tokens": hostile_max_tokens}
    return draw(mutated(base, hostile_fields))


api_keys = st.sampled_from([API_KEY] * 40 + [None, "", "sk-wrong", API_KEY + "x", API_KEY.upper(), b"Bearer \xff\xfe",
                                            b"Basic " + API_KEY.encode(), b"bearer " + API_KEY.encode(), b"Bearer"])


# -- the OpenAI routes ------------------------------------------------------------------------

@fuzz(150)
@given(body=completion_bodies(), key=api_keys)
def test_completions_answer_2xx_or_an_openai_4xx(cluster, body, key):
    status, payload, events = send(cluster, "POST", "/v1/completions", encode(body), bearer(key))
    if key != API_KEY:
        assert status == 401 and payload["error"]["type"] == "authentication_error", payload
    check_completion(body, status, payload, events, chat=False)
    assert_still_serves(cluster)
    assert_nothing_leaks(cluster)


@fuzz(120)
@given(body=chat_bodies(), key=api_keys)
def test_chat_completions_answer_2xx_or_an_openai_4xx(cluster, body, key):
    status, payload, events = send(cluster, "POST", "/v1/chat/completions", encode(body), bearer(key))
    if key != API_KEY:
        assert status == 401 and payload["error"]["type"] == "authentication_error", payload
    check_completion(body, status, payload, events, chat=True)
    assert_still_serves(cluster)
    assert_nothing_leaks(cluster)


def _valid_raw() -> bytes:
    return encode({**KNOWN_GOOD, "max_tokens": 2})


raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=40).map(lambda s: s.encode("utf-8")),
    st.integers(0, len(_valid_raw()) - 1).map(lambda i: _valid_raw()[:i]),  # cut anywhere
    st.sampled_from([
        b"", b"null", b"true", b"0", b"-0", b"1e999", b"[]", b"{}", b'""', b"NaN", b"Infinity",
        _valid_raw() + b"garbage", _valid_raw() + b"{}", b"\xef\xbb\xbf" + _valid_raw(),
        _valid_raw().decode().encode("utf-16"), _valid_raw().decode().encode("utf-32"),
        b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        b'{"model": "tiny", "prompt": ' + b"[" * 20_000 + b"1" + b"]" * 20_000 + b"}",
        b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"model": "tiny", "prompt": "x", "max_tokens": 1e400}',
        b'{"model": "tiny", "prompt": "x", "max_tokens": -0}',
        b'{"model": "tiny", "prompt": "x", "max_tokens": 2.0}',
        b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "max_tokens": "two"}',
        b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
        b'{"model": "tiny", "prompt": "x", "top_p": -Infinity}',
        b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}',
        b'{"model": "tiny", "prompt": "\\udfff\\ud800", "max_tokens": 2}',
        b'{"model": "tiny", "prompt": "ok", "stop": ["\\ud800"], "max_tokens": 2}',
        b'{"model": "tiny", "prompt": "ok\\u0000", "max_tokens": 2}',
        b'{"model": "tiny", "prompt": "\xff\xfe", "max_tokens": 2}',
        b'{"model": "tiny", "prompt": "\xed\xa0\x80", "max_tokens": 2}',  # a surrogate encoded as UTF-8
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
        b'{"model": "\\ud800", "prompt": "x"}',
        b'{"\\ud800": 1, "model": "tiny", "prompt": "x", "max_tokens": 2}',
    ]),
)
content_types = st.sampled_from(["application/json"] * 4 + [
    "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "",
    "application/json; charset=utf-16"])


@fuzz(100)
@given(raw=raw_bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), content_type=content_types)
def test_bodies_that_are_not_requests_get_a_4xx(cluster, raw, path, content_type):
    status, payload, events = send(cluster, "POST", path, raw, {**bearer(API_KEY), "content-type": content_type})
    if status == 200:
        body = json.loads(raw)
        check_completion(body, status, payload, events, chat=path.endswith("chat/completions"))
    assert_still_serves(cluster)
    assert_nothing_leaks(cluster)


@fuzz(40)
@given(key=api_keys, query=st.sampled_from(["", "?limit=-1", "?x=%ff%fe", "?" + "a" * 4000]),
       method=st.sampled_from(["GET", "GET", "GET", "POST", "DELETE", "PUT"]))
def test_models_answer_the_model_or_an_openai_4xx(cluster, key, query, method):
    status, payload, _ = send(cluster, method, "/v1/models" + query, b"", bearer(key))
    if key != API_KEY:
        assert status == 401, payload
    elif method == "GET":
        assert status == 200 and [m["id"] for m in payload["data"]] == [MODEL], payload
    else:
        assert status == 405, payload


# -- the workers' routes ----------------------------------------------------------------------

worker_tokens = st.sampled_from([TOKEN] * 40 + [None, "", "wrong", API_KEY, b"Bearer \xc3\xa9",
                                                b"Bearer  " + TOKEN.encode()])
urls = st.one_of(
    st.sampled_from(["http://127.0.0.1:9", "http://127.0.0.1:1/", "https://192.0.2.1:8443", "http://[::1]:9",
                     "http://127.0.0.1:9/path", "ftp://127.0.0.1:9", "http://", "http:// 127.0.0.1", "",
                     "http://" + "a" * 300, "javascript:alert(1)", "http://127.0.0.1:99999"]),
    st.text(max_size=30), hostile)


def restore_registry(cluster) -> None:
    """What the real workers' next heartbeats would do within a second, now, so that each example
    starts as the first did: workers that do not exist leave, the real ones report their real stats."""
    router = cluster["router"]
    real = {cluster["p"].url: cluster["p"], cluster["d"].url: cluster["d"]}
    for entry in router.registry.workers():
        if entry.url in real:
            stats = real[entry.url].worker.stats()
            router.registry.heartbeat(entry.worker_id, stats, TOKEN)
        else:
            router.registry.remove(entry.worker_id)


@st.composite
def register_bodies(draw, model_hash: str) -> dict:
    base = {"url": draw(urls), "role": draw(st.sampled_from(["prefill", "decode", "both"])),
            "model_hash": draw(st.sampled_from([model_hash, model_hash, "0" * 64, model_hash[:12], ""]))}
    hostile_fields = {"url": hostile, "role": st.one_of(st.sampled_from(["PREFILL", "", "router", "both "]), hostile),
                      "model_hash": st.one_of(st.just("h" * 200), hostile)}
    return draw(mutated(base, hostile_fields))


stat_names = st.sampled_from(["running", "waiting", "waiting_for_kv", "queued_prefill_tokens", "kv_blocks_used",
                              "kv_blocks_total", "step_latency_ewma_ms", "kv_bytes_received", "role", "model_hash",
                              "engine_alive", "stale"])
stats_values = st.one_of(
    st.sampled_from([0, 1, 2**40]), st.integers(0, 2**40), st.floats(0, 1e9),  # what a load report may hold
    st.sampled_from(EDGE_INTS), st.floats(), st.booleans(), st.none(), small_text,
    st.integers(250, 300).map(lambda n: "s" * n), junk)


REAL_WORKERS = ("<the prefill worker's id>", "<the decode worker's id>")  # replaced as the body is sent


@st.composite
def heartbeat_bodies(draw) -> dict:
    names = st.one_of(stat_names, stat_names, small_text, st.integers(60, 70).map(lambda n: "k" * n))
    stats = dict(draw(st.dictionaries(names, stats_values, max_size=6)))  # a copy: failures print what was sent
    if draw(st.booleans()):  # a counter the router sums over its workers, of any type a stat may have
        stats["kv_bytes_received"] = draw(st.one_of(st.integers(0, 2**40), st.floats(), st.booleans(), st.none(),
                                                    small_text, st.sampled_from(EDGE_INTS)))
    if draw(one_in(20)):
        stats.update({f"k{i}": i for i in range(130)})  # past the number of stats a heartbeat may carry
    base = {"worker_id": draw(st.one_of(st.sampled_from(REAL_WORKERS), st.sampled_from(REAL_WORKERS), small_text)),
            "stats": stats}
    return draw(mutated(base, {"worker_id": st.one_of(st.just("w" * 65), hostile), "stats": hostile},
                        spoiled=st.sampled_from([0, 0, 0, 1])))


@fuzz(120)
@given(data=st.data(), token=worker_tokens, route=st.sampled_from(["register", "heartbeat", "heartbeat"]))
def test_internal_routes_answer_2xx_or_an_openai_4xx(cluster, data, token, route):
    router = cluster["router"]
    if route == "register":
        body = data.draw(register_bodies(cluster["model_hash"]), label="body")
    else:
        body = data.draw(heartbeat_bodies(), label="body")
        if isinstance(body, dict) and body.get("worker_id") in REAL_WORKERS:
            role = ("prefill", "decode")[REAL_WORKERS.index(body["worker_id"])]
            body["worker_id"] = next((w.worker_id for w in router.registry.workers() if w.role == role), "w1")
    try:
        status, payload, _ = send(cluster, "POST", f"/internal/{route}", encode(body), bearer(token))
        if token != TOKEN:
            assert status == 401 and payload["error"]["type"] == "authentication_error", payload
        if route == "register" and status == 200:
            assert payload["worker_id"] and payload["lease_s"] > 0, payload
        # what a token holder told the router must not break what it answers anyone else
        for path in ("/health", "/metrics"):
            assert send(cluster, "GET", path)[0] == 200
        assert_still_serves(cluster)
    finally:
        restore_registry(cluster)


# what a heartbeat's schema lets through: any of its value types, under any name, from a real worker
stat_value = st.one_of(st.integers(-2**63, 2**64), st.floats(), st.booleans(), st.none(), st.text(max_size=256))


@fuzz(60)
@given(stats=st.dictionaries(st.one_of(stat_names, st.text(max_size=64)), stat_value, max_size=8),
       role=st.sampled_from(["prefill", "decode"]))
def test_stats_a_heartbeat_accepts_leave_every_route_answering(cluster, stats, role):
    router = cluster["router"]
    worker_id = next(w.worker_id for w in router.registry.workers() if w.role == role)
    try:
        status, payload, _ = send(cluster, "POST", "/internal/heartbeat",
                                  encode({"worker_id": worker_id, "stats": stats}), bearer(TOKEN))
        assert status in (200, 400, 404), payload  # 404: the real worker re-registered in between
        for path in ("/health", "/metrics"):
            assert send(cluster, "GET", path)[0] == 200
        assert_still_serves(cluster)
    finally:
        restore_registry(cluster)


# -- and afterwards ---------------------------------------------------------------------------

def test_after_the_fuzz_nothing_leaks(cluster):
    """Runs last in this module: every request the fuzz made has let go of its blocks and slots."""
    assert_still_serves(cluster)
    assert_nothing_leaks(cluster)
    status, payload, _ = send(cluster, "GET", "/health")
    assert status == 200 and payload["workers"] == 2, payload
