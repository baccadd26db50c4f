"""Property-based fuzz of a worker's control routes, against real workers in this process (one of
role "both", and a prefill/decode pair), every one with the worker token set.

The rule: whatever a peer sends, a worker answers 2xx or a 4xx in the OpenAI error shape, never a
5xx and never nothing; a streamed 200 ends with its finished line (an error line, if any, in the
same shape); afterwards the worker still generates the greedy tokens of a fixed prompt, and once
each example is over no worker holds a request, a lease or a KV block, and no engine step failed.
"""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.openai_shape import assert_openai_error, bearer, note
from tests.penalty_strategies import penalty_fields
from tests.wait import wait_for
from tests.worker.cluster import Cluster, WorkerServer, prompt

TOKEN = "fuzz-worker-token"
TIMEOUT_S = 30.0  # no answer within this is a hang, and a failure
MAX_FENCE = (1 << 63) - 1
GOOD_PROMPT = prompt(12, seed=3)
GOOD_SAMPLING = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


def fuzz(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])


def closed_port() -> int:
    """A port nothing listens on (for as long as nothing takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the workers ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def workers(tiny_llama):
    # a connection per request: a server that drops one after an answer cannot fail the next example
    no_reuse = httpx.Limits(max_keepalive_connections=0)
    with (WorkerServer(tiny_llama, "both", ["tcp", "shm"], TOKEN) as both,
          Cluster(tiny_llama, "tcp,shm", token=TOKEN) as pair,
          httpx.Client(timeout=TIMEOUT_S, limits=no_reuse) as client):
        p, d = pair.p, pair.d
        ws = {"both": both, "prefill": p, "decode": d, "client": client, "closed_port": closed_port(),
              "model_hash": p.worker.layout.model_hash}
        reference = generated(ws, both)
        assert len(reference) == GOOD_SAMPLING["max_tokens"]
        ws["reference"] = reference
        assert generated(ws, d, prefill_url=p.url) == reference  # the disaggregated path agrees
        yield ws


def send(ws, method: str, url: str, content: bytes | None = b"", secret=TOKEN, allow_5xx=lambda payload: False):
    """(status, parsed body): JSON, the NDJSON lines of a streamed generate, or the text of /metrics.
    Fails on a 5xx (unless `allow_5xx` says this one is a peer's outage, not a fault), a malformed
    answer, or no answer within TIMEOUT_S."""
    path = httpx.URL(url).path
    try:
        with ws["client"].stream(method, url, content=content,
                                 headers={"content-type": "application/json", **bearer(secret)}) as r:
            if r.status_code == 200 and r.headers.get("content-type", "").startswith("application/x-ndjson"):
                note(f"{method} {path}: 200 (streamed)")
                return 200, read_ndjson(r)
            raw = r.read()
    except httpx.TimeoutException as e:
        pytest.fail(f"{method} {url}: no answer within {TIMEOUT_S:.0f} s ({type(e).__name__})")
    status = r.status_code
    note(f"{method} {path}: {status}")
    if path == "/metrics" and status == 200:
        return status, raw.decode()
    try:
        payload = json.loads(raw)
    except ValueError:
        pytest.fail(f"{method} {path} answered {status} with a body that is not JSON: {raw[:2000]!r}")
    if status >= 400:
        assert_openai_error(payload, status)
    assert status < 500 or allow_5xx(payload), f"{method} {path} answered {status}: {raw[:2000]!r}"
    assert 200 <= status < 300 or 400 <= status < 600, f"{method} {path} answered {status}: {raw[:2000]!r}"
    return status, payload


def read_ndjson(r: httpx.Response) -> list[dict]:
    """The lines of a streamed generate: keep-alive blank lines aside, JSON objects up to the one
    that finishes the request, or an error line in the OpenAI shape (never a server error)."""
    lines: list[dict] = []
    for text in r.iter_lines():
        if not text.strip():
            continue
        assert not lines or not (lines[-1].get("finished") or "error" in lines[-1]), f"a line after the last: {text!r}"
        line = json.loads(text)
        assert isinstance(line, dict), line
        if "error" in line:
            assert_openai_error(line, line["error"].get("code"))
            assert line["error"]["code"] < 500, f"a server error inside the stream: {line}"
        lines.append(line)
    assert lines and (lines[-1].get("finished") or "error" in lines[-1]), f"the stream ended unfinished: {lines[-3:]}"
    return lines


def check_generation(body: object, status: int, lines: object) -> None:
    """A 200's lines agree with what was asked: n completions, none past max_tokens, each finished."""
    if status != 200:
        return
    assert isinstance(body, dict) and isinstance(lines, list), lines
    if lines and "error" in lines[-1]:
        return
    sampling = body.get("sampling") or {}
    n, max_tokens = sampling.get("n", 1), sampling.get("max_tokens", 16)
    tokens: dict[int, int] = {}
    reasons: dict[int, str] = {}
    for line in lines:
        for out in line["outputs"]:
            assert 0 <= out["index"] < n, out
            tokens[out["index"]] = tokens.get(out["index"], 0) + len(out["token_ids"])
            if out["finish_reason"] is not None:
                reasons[out["index"]] = out["finish_reason"]
    assert lines[-1]["finished"] and set(reasons) == set(range(n)), (reasons, lines[-2:])
    assert set(reasons.values()) <= {"stop", "length"}, reasons
    if max_tokens is not None:
        resumed = len(body.get("output_token_ids") or [])
        assert all(count + resumed <= max_tokens for count in tokens.values()), (tokens, max_tokens)


def generated(ws, w: WorkerServer, prefill_url: str | None = None) -> list[int]:
    body = {"prompt_token_ids": GOOD_PROMPT, "sampling": GOOD_SAMPLING, "prefill_url": prefill_url, "stream": False}
    status, lines = send(ws, "POST", w.url + "/v1/generate", json.dumps(body).encode())
    assert status == 200, lines
    return [t for line in lines for t in line["outputs"][0]["token_ids"]]


def assert_still_generates(ws, *targets: str) -> None:
    """Each worker named still computes the reference's greedy tokens; a decode worker with the
    prefill worker's KV, which must land (the prefill worker still serves leases)."""
    for name in targets:
        if name == "decode":
            d = ws["decode"]
            landed = d.worker.stats().kv_landed
            assert generated(ws, d, prefill_url=ws["prefill"].url) == ws["reference"]
            assert d.worker.stats().kv_landed == landed + 1, d.worker.stats()
        else:
            assert generated(ws, ws[name]) == ws["reference"], name


def assert_idle(ws) -> None:
    """No worker holds a request, a lease, a shipment or a block, and no engine step failed."""
    all_ = [ws["both"], ws["prefill"], ws["decode"]]
    # aborts and fallbacks settle within a second or two
    wait_for(lambda: all(w.is_idle() for w in all_), 15, "every worker idle",
             state=lambda: {name: ws[name].worker.stats() for name in ("both", "prefill", "decode")})
    for w in all_:
        stats = w.worker.stats()
        assert stats.engine_failures == 0 and stats.requests_failed == 0, stats


def encode(body: object) -> bytes:
    # ensure_ascii writes lone surrogates as "\ud800" escapes; allow_nan writes NaN and Infinity,
    # which the server's parser reads: both must be refused by validation
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


def one_in(n: int) -> st.SearchStrategy[bool]:
    """True about once in n draws (`st.integers(0, n - 1) == 0` would be true far more often:
    Hypothesis favours small integers)."""
    return st.sampled_from([False] * (n - 1) + [True])


# -- values -----------------------------------------------------------------------------------

EDGE_INTS = [0, -1, 1, 2, 8, 16, 31, 128, 129, 255, 511, 512, 1000, 1023, 1024, 1025, 2**20, 2**20 + 1, 2**24,
             2**24 + 1, 2**31 - 1, 2**31, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, -2**63, -2**63 - 1, 10**30]
SPECIAL_TEXT = ["", " ", "\u200b", "\u202e", "\x00", "\n", "😀", "مرحبا", "#", "@", "x#1", "a@b", "../..", "%00"]
SURROGATE = st.characters(categories=["Cs"])
small_text = st.one_of(st.text(max_size=12), st.sampled_from(SPECIAL_TEXT))
surrogate_text = st.tuples(small_text, SURROGATE).map("".join)
numbers = st.one_of(st.sampled_from(EDGE_INTS), st.integers(), st.floats(), st.booleans())
scalars = st.one_of(st.none(), st.booleans(), numbers, small_text, surrogate_text)
junk = st.one_of(
    scalars,
    st.lists(scalars, max_size=4),
    st.dictionaries(small_text, scalars, max_size=3),
    st.lists(st.one_of(st.lists(scalars, max_size=2), st.dictionaries(small_text, scalars, max_size=2)), max_size=2),
)
hostile = st.one_of(numbers, junk, st.none())

request_ids = st.from_regex(r"[A-Za-z0-9_.:\-]{1,24}", fullmatch=True)
hostile_request_ids = st.one_of(st.sampled_from(["", "x" * 201, "line\nbreak", "a b", "x#1", "a@b", "é"]),
                                surrogate_text, hostile)
token_ids = st.lists(st.integers(1, 511), min_size=1, max_size=20)
hostile_token_ids = st.one_of(
    st.lists(st.one_of(st.sampled_from(EDGE_INTS), st.integers(), st.floats(), st.booleans(), small_text),
             max_size=8),
    st.sampled_from([[], [[1]], [512], [0], [5] * 1030, [5] * 1020]),
    hostile,
)


@st.composite
def mutated(draw, base: dict, hostile_fields: dict, spoiled=st.sampled_from([0, 0, 1, 1, 1, 2, 3]),
            favoured: tuple[str, ...] = ()) -> dict:
    """`base` (valid) with up to three fields made hostile, removed or null (the `favoured` ones
    more often), and maybe an extra one; by default a third of the bodies are valid as they come."""
    body = dict(base)
    how_many = min(draw(spoiled), len(hostile_fields))
    names = sorted(hostile_fields) + [name for name in favoured for _ in range(3)]
    for name in draw(st.lists(st.sampled_from(names), min_size=how_many, max_size=how_many, unique=True)):
        action = draw(st.sampled_from(["hostile", "hostile", "delete", "null"]))
        if action == "hostile":
            body[name] = draw(hostile_fields[name])
        elif action == "delete":
            body.pop(name, None)
        else:
            body[name] = None
    if draw(one_in(16)):
        body[draw(st.sampled_from(["extra", "model", "", "__class__"]))] = draw(junk)
    return body


# SamplingParams' fields: (valid values, hostile values)
SAMPLING_FIELDS = {
    "n": (st.integers(1, 3), st.one_of(st.sampled_from([0, 128, 129, -1]), hostile)),
    "temperature": (st.floats(0, 2), st.one_of(st.sampled_from([100.0, 100.5, -0.0, 1e-300]), st.floats(), hostile)),
    "top_p": (st.floats(0.001, 1), st.one_of(st.sampled_from([5e-324, 1e-300]), st.floats(), hostile)),
    "top_k": (st.integers(-1, 600), st.one_of(st.sampled_from([2**20, 2**20 + 1, -2]), hostile)),
    "min_p": (st.floats(0, 1), st.one_of(st.floats(), hostile)),
    "seed": (st.integers(0, 2**63 - 1), hostile),
    "max_tokens": (st.integers(1, 8), st.one_of(st.sampled_from([None, 0, 1000, 1024, 2**24, 2**24 + 1]), hostile)),
    "min_tokens": (st.integers(0, 3), st.one_of(st.sampled_from([8, 9, 1000, 2**24 + 1]), hostile)),
    "stop": (st.lists(st.text(min_size=1, max_size=6), max_size=4),
             st.one_of(st.lists(st.one_of(st.text(max_size=300), surrogate_text), max_size=20), hostile)),
    "stop_token_ids": (st.lists(st.integers(0, 511), max_size=4),
                       st.one_of(st.lists(st.one_of(st.sampled_from(EDGE_INTS), st.integers()), max_size=70),
                                 hostile)),
    "ignore_eos": (st.booleans(), hostile),
    "include_stop_str_in_output": (st.booleans(), hostile),
    "skip_special_tokens": (st.booleans(), hostile),
    **penalty_fields(hostile),
    "structure": (st.sampled_from([{"kind": "regex", "spec": "[a-z]{1,3}"}, {"kind": "choice", "spec": '["a", "bc"]'}]),
                  st.one_of(st.fixed_dictionaries({"kind": st.sampled_from(["json", "regex", "choice", "grammar", "x"]),
                                                   "spec": st.text(max_size=40)}), hostile)),
}


@st.composite
def sampling_dicts(draw) -> dict:
    base = {"temperature": 0.0, "max_tokens": draw(st.integers(1, 8)),
            **draw(st.fixed_dictionaries({}, optional={k: v for k, (v, _) in SAMPLING_FIELDS.items()}))}
    hostile_fields = {k: bad for k, (_, bad) in SAMPLING_FIELDS.items()}
    body = draw(mutated(base, hostile_fields))
    if draw(one_in(16)):  # names SamplingParams does not have
        body.update(draw(st.dictionaries(st.sampled_from(["self", "a b", "", "max_tokens ", "__class__", "logprobs",
                                                          "clone", "greedy", "😀"]), junk, min_size=1, max_size=3)))
    if draw(one_in(40)):
        body.update({f"k{i}": i for i in range(33)})  # past the number of fields a sampling dict may have
    limit = body.get("max_tokens")
    if not (type(limit) is int and limit <= 8) and type(body.get("n")) is int and body["n"] > 1:
        body["n"] = 1  # hundreds of tokens times n are slow on a CPU, and prove nothing one does not
    return body


def prefill_urls(ws) -> st.SearchStrategy:
    """Where a decode worker is told to lease the prompt's KV: the prefill worker, itself or another
    worker that serves leases, or an address where nothing (or nothing of ours) answers."""
    return st.sampled_from([None, ws["prefill"].url, ws["prefill"].url, ws["both"].url, ws["decode"].url,
                            f"http://127.0.0.1:{ws['closed_port']}", ws["prefill"].url + "/",
                            ws["prefill"].url + "/v1", "http://127.0.0.1:99999", "http://[::1]:1"])


def hostile_prefill_urls(ws) -> st.SearchStrategy:
    return st.one_of(prefill_urls(ws), st.sampled_from(["file:///etc/passwd", "http://", "ftp://127.0.0.1:1",
                                                        "http://" + "a" * 256, "http:// 127.0.0.1"]),
                     small_text, hostile)


@st.composite
def generate_bodies(draw, ws) -> dict:
    base = {"prompt_token_ids": draw(token_ids), "sampling": draw(sampling_dicts()), "stream": draw(st.booleans()),
            **draw(st.fixed_dictionaries({}, optional={
                "request_id": st.one_of(request_ids, st.none()),
                "output_token_ids": st.lists(st.integers(1, 511), max_size=3),
                "priority": st.integers(-1000, 1000),
                "prefill_url": prefill_urls(ws)}))}
    hostile_fields = {"request_id": hostile_request_ids, "prompt_token_ids": hostile_token_ids,
                      "output_token_ids": hostile_token_ids, "sampling": hostile,
                      "priority": st.one_of(st.sampled_from([1001, -1001, 2**63]), hostile),
                      "prefill_url": hostile_prefill_urls(ws), "stream": hostile}
    return draw(mutated(base, hostile_fields))


secrets = st.sampled_from([TOKEN] * 80 + [None, "", "wrong", TOKEN.upper(), b"Bearer \xff", b"bearer " + TOKEN.encode(),
                                          b"Bearer  " + TOKEN.encode()])


# -- generate ---------------------------------------------------------------------------------

@fuzz(150)
@given(data=st.data(), target=st.sampled_from(["both", "both", "decode", "prefill"]), secret=secrets)
def test_generate_answers_2xx_or_an_openai_4xx(workers, data, target, secret):
    body = data.draw(generate_bodies(workers), label="body")
    status, payload = send(workers, "POST", workers[target].url + "/v1/generate", encode(body), secret)
    if secret != TOKEN:
        assert status == 401, payload
    check_generation(body, status, payload)
    assert_idle(workers)
    assert_still_generates(workers, target)


# -- leases -----------------------------------------------------------------------------------

def real_offers(ws) -> list[dict]:
    """How the decode and the colocated worker are reached, whole or one backend at a time (the
    prefill side tries tcp first: a lone shm offer is the way to make it write in place)."""
    d, both = ws["decode"].worker, ws["both"].worker
    return [d.offers, both.offers] + [{name: offer} for w in (d, both) for name, offer in w.offers.items()]


# placeholders for the fixture's own ports and pool, replaced by `resolve`
RECEIVER_PORT, CLOSED_PORT, HTTP_PORT = "<receiver port>", "<closed port>", "<an HTTP port>"
POOL_PATH, OTHER_POOL_PATH, POOL_SLOTS, MORE_SLOTS = "<pool path>", "<pool path+x>", "<pool slots>", "<pool slots+1>"


def resolve(ws, value: object) -> object:
    """`value` with the placeholders above replaced by the decode worker's real ones."""
    d = ws["decode"].worker.offers
    shm = d.get("shm", {"path": "/dev/shm/none", "num_slots": 8})
    real = {RECEIVER_PORT: d["tcp"]["port"], CLOSED_PORT: ws["closed_port"],
            HTTP_PORT: httpx.URL(ws["prefill"].url).port,
            POOL_PATH: shm["path"], OTHER_POOL_PATH: shm["path"] + "x", POOL_SLOTS: shm["num_slots"],
            MORE_SLOTS: shm["num_slots"] + 1}
    if isinstance(value, dict):
        return {k: resolve(ws, v) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(ws, v) for v in value]
    return real.get(value, value) if isinstance(value, str) else value


ODD_PORTS = [CLOSED_PORT, 0, -1, 65536, 2**31, 2**63, 2**70, -2**70, "abc", "", " 1", None, [], {}, 1.5,
             float("inf"), float("-inf"), float("nan"), True]
# one field of a real offer at a time: every value listed is tried (the lists are small)
ODD_OFFER_FIELDS = {
    ("tcp", "host"): ["", None, "localhost", "::1", "0.0.0.0", "\x00", "a" * 300, "\ud800", "127.0.0.1\n", 5, 1.5,
                      True, [], {}],
    ("tcp", "port"): ODD_PORTS + [HTTP_PORT],  # something listens there, not a KV receiver: a 5 s handshake
    ("shm", "path"): [OTHER_POOL_PATH, "/etc/passwd", "/dev/zero", "", "\x00", "/", "/dev/shm/../etc/passwd", "\ud800",
                      None, 5, [], {}],
    ("shm", "num_slots"): [0, -1, MORE_SLOTS, 2**63, 2**70, "many", "16384", "", 1e300, float("inf"), float("nan"),
                           None, [], True],
    ("shm", "port"): ODD_PORTS,
}
junk_offers = st.dictionaries(st.sampled_from(["tcp", "shm", "nixl"]),
                              st.dictionaries(st.sampled_from(["host", "port", "path", "num_slots", "agent", ""]),
                                              junk, max_size=4), max_size=3)


@st.composite
def lease_bodies(draw, ws) -> dict:
    tokens = draw(token_ids)
    resumed = draw(st.one_of(st.just([]), st.lists(st.integers(1, 511), max_size=3)))
    end = len(tokens) + len(resumed)
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16, 1024]))
    needed = -(-end // block_size)
    num_blocks = ws["decode"].worker.engine.block_manager.num_blocks
    base = {
        "request_id": draw(request_ids), "fence": draw(st.integers(0, MAX_FENCE)),
        "prompt_token_ids": tokens, "output_token_ids": resumed,
        "sampling": draw(st.one_of(st.just({}), sampling_dicts())),
        "start": draw(st.integers(0, end - 1)),
        "block_table": draw(st.lists(st.integers(0, num_blocks // max(1, block_size // 8) - 1), min_size=needed,
                                     max_size=needed + 2)),
        "block_size": block_size, "model_hash": ws["model_hash"],
        "kv_transfer_dtype": draw(st.sampled_from(["auto", "auto", "int8", "fp8"])),
        "decode": draw(st.sampled_from(real_offers(ws))),
    }
    table_ids = st.one_of(st.sampled_from([-1, -2**31, num_blocks, num_blocks * 64, 2**31 - 1, 2**31, 2**63]),
                          st.integers(0, num_blocks - 1))
    hostile_fields = {
        "request_id": hostile_request_ids,
        "fence": st.one_of(st.sampled_from([-1, 0, MAX_FENCE, MAX_FENCE + 1, 2**64, True, 1.0]), hostile),
        "prompt_token_ids": hostile_token_ids, "output_token_ids": hostile_token_ids, "sampling": hostile,
        "start": st.one_of(st.sampled_from([end, end + 1, -1, 2**20, 2**20 + 1, 2**63, 1.5]), hostile),
        "block_table": st.one_of(
            st.just(base["block_table"][:-1]),  # too short
            st.lists(st.integers(0, 10), min_size=needed + 65, max_size=needed + 70),  # too long
            st.lists(table_ids, min_size=needed, max_size=needed + 1),  # negative, or past the pool
            st.just([]), hostile),
        "block_size": st.one_of(st.sampled_from([0, -4, 3, 12, 2048, 2**31, 2**63, 4.0, True]), hostile),
        "model_hash": st.one_of(st.sampled_from(["0" * 64, "", ws["model_hash"][:12], "h" * 129]), hostile),
        "kv_transfer_dtype": st.one_of(st.sampled_from(["int4", "FP8", "", "raw"]), hostile),
        "decode": st.one_of(junk_offers, hostile),
        # a draft model's blocks (these workers draft with none: bounded, checked, never written)
        "draft_block_table": st.one_of(
            st.just(base["block_table"][:-1]),
            st.lists(st.integers(0, 10), min_size=needed + 65, max_size=needed + 70),
            st.lists(table_ids, min_size=needed, max_size=needed + 1), hostile),
        "draft_hash": st.one_of(st.sampled_from(["", "d" * 64, "h" * 129]), hostile),
    }
    return draw(mutated(base, hostile_fields, spoiled=st.sampled_from([0, 0, 1, 1, 1, 2]),
                        favoured=("block_table", "decode", "start", "fence", "block_size")))


def a_peer_outage(payload: dict) -> bool:
    """A prefill worker that cannot reach the decode worker named in a lease answers 503: the
    decode worker recomputes the prompt itself, and may lease the next one elsewhere."""
    err = payload.get("error", {})
    return (err.get("code") == 503 and err.get("type") == "kv_transfer_error"
            and err.get("message", "").startswith("no KV transfer backend reaches the decode worker"))


@st.composite
def hostile_leases(draw, ws, offers: str) -> dict:
    """A lease of a short prompt, naming a real decode offer, whose table, start, block size and
    fence are anything the schema lets through, and a little beyond (past the pool, one block short)."""
    tokens = draw(token_ids)
    block_size = draw(st.sampled_from([4, 8, 1, 16, 1024, 3, 0]))
    needed = -(-len(tokens) // max(1, block_size))
    pool_slots = ws["decode"].worker.engine.block_manager.num_blocks * 8
    in_pool = st.integers(0, max(0, pool_slots // max(1, block_size) - 1))
    odd_id = draw(st.sampled_from([pool_slots // max(1, block_size), pool_slots, 2**31 - 1, -1, 2**31, 2**63]))
    ids = draw(st.lists(in_pool, min_size=needed + 65, max_size=needed + 65))
    table = {
        "fits": ids[:needed],
        "spare blocks": ids[:needed + 64],
        "one short": ids[:needed - 1],
        "too long": ids,
        "last odd": ids[:needed - 1] + [odd_id],
        "first odd": [odd_id] + ids[1:needed],
        "empty": [],
    }[draw(st.sampled_from(["fits", "last odd", "first odd", "spare blocks", "one short", "too long", "empty"]))]
    d, both = ws["decode"].worker.offers, ws["both"].worker.offers
    decode = {"decode tcp": {"tcp": d["tcp"]}, "decode shm": {"shm": d.get("shm")},
              "colocated shm": {"shm": both.get("shm")}}[offers]
    return {
        "request_id": draw(request_ids),
        "fence": draw(st.one_of(st.integers(0, MAX_FENCE), st.sampled_from([0, MAX_FENCE, -1, MAX_FENCE + 1]))),
        "prompt_token_ids": tokens, "sampling": {},
        "start": draw(st.sampled_from([0, len(tokens) - 1, len(tokens) // 2, len(tokens), -1, 2**20])),
        "block_table": table, "block_size": block_size, "model_hash": ws["model_hash"],
        "kv_transfer_dtype": draw(st.sampled_from(["auto", "auto", "int8", "fp8"])),
        "decode": decode,
    }


@pytest.mark.parametrize("offers", ["decode tcp", "decode shm", "colocated shm"])
@fuzz(30)
@given(data=st.data(), target=st.sampled_from(["prefill", "prefill", "both", "decode"]))
def test_leases_with_hostile_tables_and_fences_answer_2xx_or_an_openai_4xx(workers, offers, data, target):
    body = data.draw(hostile_leases(workers, offers), label="body")
    send(workers, "POST", workers[target].url + "/v1/prefill", encode(body), allow_5xx=a_peer_outage)
    assert_idle(workers)  # an accepted lease's prefill ran, its writes were refused as stale, and it let go
    assert_still_generates(workers, "decode", *([target] if target == "both" else []))


def lease_naming(ws, offers: dict) -> dict:
    """A lease valid in every field but, maybe, its decode offers."""
    return {"request_id": "offers", "fence": 7, "prompt_token_ids": GOOD_PROMPT[:5], "sampling": {}, "start": 0,
            "block_table": [0, 1], "block_size": 4, "model_hash": ws["model_hash"], "decode": resolve(ws, offers)}


@pytest.mark.parametrize("backend, field", list(ODD_OFFER_FIELDS))
@fuzz(30)
@given(data=st.data())
def test_leases_naming_an_odd_decode_offer_answer_2xx_or_an_openai_4xx(workers, backend, field, data):
    value = data.draw(st.sampled_from(ODD_OFFER_FIELDS[backend, field]), label=field)
    offer = dict(workers["decode"].worker.offers.get(backend, {"host": "127.0.0.1", "port": RECEIVER_PORT}))
    offer[field] = value
    # a fresh connection for each example: a pooled one, to the same address, would answer for an
    # offer it was not made from (num_slots, say), and the outcome would hang on the examples before
    workers["prefill"].worker.prefill.close()
    send(workers, "POST", workers["prefill"].url + "/v1/prefill", encode(lease_naming(workers, {backend: offer})),
         allow_5xx=a_peer_outage)
    assert_idle(workers)
    assert_still_generates(workers, "decode")


@fuzz(30)
@given(offers=junk_offers, target=st.sampled_from(["prefill", "both", "decode"]))
def test_leases_naming_junk_decode_offers_answer_2xx_or_an_openai_4xx(workers, offers, target):
    send(workers, "POST", workers[target].url + "/v1/prefill", encode(lease_naming(workers, offers)),
         allow_5xx=a_peer_outage)
    assert_idle(workers)
    assert_still_generates(workers, "decode", *([target] if target == "both" else []))


@fuzz(100)
@given(data=st.data(), target=st.sampled_from(["prefill", "prefill", "both", "decode"]), secret=secrets)
def test_prefill_leases_answer_2xx_or_an_openai_4xx(workers, data, target, secret):
    body = data.draw(lease_bodies(workers), label="body")
    status, payload = send(workers, "POST", workers[target].url + "/v1/prefill", encode(body), secret,
                           allow_5xx=a_peer_outage)
    if secret != TOKEN:
        assert status == 401, payload
    if status == 200:
        assert payload["request_id"] == body["request_id"] and payload["fence"] == body["fence"], payload
    assert_idle(workers)  # the lease's prefill ran, its writes were refused as stale, it let go
    assert_still_generates(workers, "decode", *([target] if target == "both" else []))


# -- aborts -----------------------------------------------------------------------------------

@st.composite
def abort_bodies(draw) -> dict:
    base = {"request_id": draw(st.sampled_from(["victim", "victim", "someone-else"]) | request_ids),
            **draw(st.fixed_dictionaries({}, optional={"fence": st.integers(0, MAX_FENCE)}))}
    return draw(mutated(base, {"request_id": hostile_request_ids,
                               "fence": st.one_of(st.sampled_from([-1, MAX_FENCE + 1, 2**64, True]), hostile)}))


@fuzz(60)
@given(body=abort_bodies(), path=st.sampled_from(["/v1/abort", "/v1/prefill/abort"]),
       target=st.sampled_from(["both", "decode", "prefill"]), victim=st.booleans(), secret=secrets)
def test_aborts_answer_2xx_or_an_openai_4xx_and_a_running_request_still_ends(workers, body, path, target, victim,
                                                                             secret):
    """With a request "victim" running (or not): whatever the abort says, its stream still ends."""
    w = workers[target]
    lines: list = []
    reader = None
    if victim:
        started = threading.Event()

        def run() -> None:
            req = {"request_id": "victim", "prompt_token_ids": GOOD_PROMPT,
                   "sampling": {"temperature": 0, "max_tokens": 64, "ignore_eos": True},
                   "prefill_url": workers["prefill"].url if target == "decode" else None}
            with workers["client"].stream("POST", w.url + "/v1/generate", json=req, headers=bearer(TOKEN)) as r:
                started.set()
                assert r.status_code == 200, r.read()
                lines.extend(read_ndjson(r))
        reader = threading.Thread(target=run)
        reader.start()
        started.wait(TIMEOUT_S)
    status, payload = send(workers, "POST", w.url + path, encode(body), secret)
    if secret != TOKEN:
        assert status == 401, payload
    if reader is not None:
        reader.join(TIMEOUT_S)
        assert not reader.is_alive(), "the running request's stream did not end"
        assert lines and lines[-1]["finished"], lines[-3:]
        assert lines[-1]["outputs"][0]["finish_reason"] in ("length", "abort"), lines[-1]
    assert_idle(workers)
    assert_still_generates(workers, target)


# -- the read-only routes ---------------------------------------------------------------------

@fuzz(40)
@given(path=st.sampled_from(["/stats", "/v1/kv_info", "/health", "/metrics"]),
       method=st.sampled_from(["GET", "GET", "GET", "POST", "PUT", "DELETE"]),
       query=st.sampled_from(["", "?x=1", "?%ff=%fe", "?" + "a" * 4000]),
       target=st.sampled_from(["both", "decode", "prefill"]), secret=secrets)
def test_read_only_routes_answer_2xx_or_an_openai_4xx(workers, path, method, query, target, secret):
    w = workers[target]
    status, payload = send(workers, method, w.url + path + query, b"", secret)
    if secret != TOKEN and path != "/health":
        assert status == 401, payload
    elif method != "GET":
        assert status == 405, payload
    elif path == "/v1/kv_info" and target == "prefill":
        assert status == 404, payload  # a prefill worker receives no KV
    else:
        assert status == 200, payload
        if path == "/stats":
            assert payload["role"] == w.worker.config.role and payload["kv_blocks_total"] > 0, payload
        elif path == "/metrics":
            assert "pdserve_worker_kv_blocks_total" in payload
        elif path == "/v1/kv_info":
            assert payload["backends"] == w.worker.offers, payload
        else:
            assert payload["status"] == "ok", payload


# -- and afterwards ---------------------------------------------------------------------------

def test_after_the_fuzz_every_worker_is_idle_and_serves(workers):
    """Runs last in this module: nothing the fuzz did is still held anywhere."""
    assert_still_generates(workers, "both", "prefill", "decode")
    assert_idle(workers)
