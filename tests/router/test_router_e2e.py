"""The official openai client against a real local cluster: router + 1 prefill + 1 decode worker
(tiny model), each behind its HTTP endpoint on 127.0.0.1."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from pdserve import SamplingParams
from pdserve.engine.request import RequestStatus
from pdserve.router.tool_calls import FORMATS, ToolCalls
from pdserve.worker.registration import RouterMembership
from tests.factories import make_llm, offline_text
from tests.router_server import MODEL, RouterServer
from tests.wait import wait_for
from tests.worker.cluster import HeldAtToken


@pytest.fixture(scope="module")
def client(router_cluster):
    return openai.OpenAI(base_url=router_cluster["url"] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return make_llm(tiny_llama)


PROMPTS = ["the quick brown fox jumps over the lazy dog", "hello world, this is a longer prompt " * 3]


def test_completions_match_offline(client, offline, router_cluster):
    landed = router_cluster["d"].worker.stats().kv_landed
    for prompt in PROMPTS:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == offline_text(offline, prompt, 12)
        assert r.usage.prompt_tokens == len(offline.get_tokenizer().encode(prompt))
        assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    assert router_cluster["d"].worker.stats().kv_landed > landed  # the prompts went through the prefill worker


def test_streaming_with_usage(client, offline):
    prompt = PROMPTS[1]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline_text(offline, prompt, 10)
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_and_stop_strings(client, offline):
    tok = offline.get_tokenizer()
    messages = [{"role": "user", "content": "name three colours"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    sp = SamplingParams(temperature=0, max_tokens=10)
    expected = offline.generate({"prompt_token_ids": ids}, sp)[0].outputs[0].text
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True) if c.choices)
    assert streamed == expected
    full = offline_text(offline, PROMPTS[0], 12)
    stop = full[3:6]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_a_stop_string_ends_only_its_own_completion(client, offline):
    """The router owns the text: it finds completion 0's stop string, cuts its text, stops it on
    the worker and counts its tokens up to the stop; completion 1 runs to its length."""
    kw = dict(n=2, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    full = [c.text for c in offline.generate(PROMPTS[0], SamplingParams(**kw))[0].outputs]
    stop = next(full[0][i:i + 3] for i in range(2, len(full[0]) - 3)
                if full[0][i:i + 3] not in full[1] and full[0][i:i + 3] not in full[0][:i + 2])
    cut = offline.generate(PROMPTS[0], SamplingParams(**kw, stop=[stop]))[0].outputs
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=1.0, seed=11, n=2,
                                  stop=[stop], extra_body={"ignore_eos": True})
    got = sorted(r.choices, key=lambda c: c.index)
    assert [c.text for c in got] == [full[0][: full[0].index(stop)], full[1]]
    assert [c.finish_reason for c in got] == ["stop", "length"]
    assert r.usage.completion_tokens == len(cut[0].token_ids) + 16
    texts, reasons = ["", ""], [[], []]
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=1.0, seed=11,
                                           n=2, stop=[stop], stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] += [c.finish_reason] if c.finish_reason else []
    assert texts == [c.text for c in got] and reasons == [["stop"], ["length"]]


def test_penalties_and_logit_bias_reach_the_model(client, offline, router_cluster):
    """Through the router and a prefill worker (first token) to the decode worker (the rest), as
    the offline engine computes them; a bias of -100 bans a token, +100 all but forces one."""
    tok = offline.get_tokenizer()
    prompt = "a prompt no other test sends, so no worker holds its KV yet: " * 2
    plain = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
    settings = dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={plain[0]: -100.0})
    landed = router_cluster["d"].worker.stats().kv_landed
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  frequency_penalty=1.5, presence_penalty=0.5,
                                  logit_bias={str(plain[0]): -100}, extra_body={"repetition_penalty": 1.2})
    sp = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.2, **settings)
    expected = offline.generate(prompt, sp)[0].outputs[0]
    assert r.choices[0].text == expected.text and expected.token_ids[0] != plain[0]
    assert router_cluster["d"].worker.stats().kv_landed > landed  # the first token came from the prefill worker
    forced = tok.encode(" banana")[-1]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logit_bias={str(forced): 100})
    assert tok.decode([forced] * 3) == chat.choices[0].message.content


def test_logprobs_through_the_router_are_the_engines(client, offline, router_cluster):
    """Chat and completions, streamed and not, through a prefill worker (the first token's entry
    travels with its KV) and the decode worker; the engine's own are checked against transformers."""
    tok = offline.get_tokenizer()
    messages = [{"role": "user", "content": "list four prime numbers, please, separated by commas"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    want = offline.generate({"prompt_token_ids": ids}, sp)[0].outputs[0].logprobs
    landed = router_cluster["d"].worker.stats().kv_landed
    asked = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                 extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**asked).choices[0].logprobs.content
    streamed = [c for chunk in client.chat.completions.create(**asked, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert router_cluster["d"].worker.stats().kv_landed > landed  # the first token came from the prefill worker
    for got in (whole, streamed):
        assert [c.token for c in got] == [tok.decode([e.token_id]) for e in want]
        assert [c.logprob for c in got] == pytest.approx([e.logprob for e in want], abs=1e-4)
        assert [[t.token for t in c.top_logprobs] for c in got] == [[tok.decode([t]) for t, _ in e.top] for e in want]
        assert all(c.bytes == list(c.token.encode()) for c in got)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    # the two most likely and the chosen one (fewer where tokens read alike: the keys are texts)
    assert lp.text_offset[0] == 0 and all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert all(lp.token_logprobs[i] == top[token] for i, (token, top) in enumerate(zip(lp.tokens, lp.top_logprobs)))


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0.9, seed=7)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


@pytest.mark.parametrize("body, status, fragment", [
    ({"model": "other", "prompt": "x"}, 404, "does not exist"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**7}, 400, "maximum context length"),
    ({"model": MODEL, "prompt": "x", "n": 1000}, 400, "n"),
    ({"model": MODEL, "prompt": 5}, 400, "prompt"),
    ({"model": MODEL, "prompt": [10**9]}, 400, "prompt token ids"),
    ({"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x"}, 400, "model"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": ""}, 400, "empty"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "seed": "abc"}, 400, "seed"),
    ({"model": MODEL, "prompt": "x", "stop": 7}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "logprobs": True}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": "maybe"}}, 400, "include_usage"),
    ({"model": MODEL, "prompt": ["a"] * 65}, 400, "prompt"),
    ({"model": MODEL, "prompt": [[1, 2], "mixed"]}, 400, "prompt"),
    ({"model": MODEL, "prompt": [-1]}, 400, "prompt.0"),
    # every numeric field is bounded at the edge; a value a worker could not take never reaches one
    ({"model": MODEL, "prompt": "x", "n": 2, "seed": 18446744073709551615}, 400, "seed"),
    ({"model": MODEL, "prompt": "x", "seed": -1}, 400, "seed"),
    ({"model": MODEL, "prompt": "x", "priority": -5}, 400, "priority"),
    ({"model": MODEL, "prompt": "x", "priority": 10**6}, 400, "priority"),
    ({"model": MODEL, "prompt": "x", "top_k": 2**40}, 400, "top_k"),
    ({"model": MODEL, "prompt": "x", "min_tokens": 2**40}, 400, "min_tokens"),
    ({"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "stop": "s" * 257}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "logprobs": {"top": 5}}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": -3}, 400, "presence_penalty"),
    ({"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"five": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {str(10**6): 1}}, 400, "logit_bias names token ids outside"),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids names token ids outside"),
    ({"model": MODEL * 100, "prompt": "x"}, 400, "model"),
    ([1, 2, 3], 400, "body"),
    ("just a string", 400, "body"),
    (None, 400, "body"),
])
def test_bad_requests(router_cluster, body, status, fragment):
    r = httpx.post(router_cluster["url"] + "/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and fragment in err["message"]


@pytest.mark.parametrize("raw, fragment", [
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"model": "tiny", "prompt": "x", "top_p": Infinity}', "top_p"),
    (b'{"model": "tiny", "prompt": "x", "min_p": -Infinity}', "min_p"),
    (b'{"model": "tiny", "prompt": "\\ud800 a lone surrogate"}', "surrogate"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', "surrogate"),
])
def test_json_that_python_reads_but_no_tokenizer_takes(router_cluster, raw, fragment):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    r = httpx.post(router_cluster["url"] + path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path, body, status, fragment", [
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/nothing", {}, 404, "Not Found"),
])
def test_bad_chat_requests(router_cluster, path, body, status, fragment):
    r = httpx.post(router_cluster["url"] + path, json=body)
    assert r.status_code == status, r.text
    if fragment:
        assert fragment in r.json()["error"]["message"]


def test_bad_bytes_and_sizes(router_cluster):
    url = router_cluster["url"] + "/v1/completions"
    headers = {"content-type": "application/json"}
    for raw in (b"{not json", b'{"model": "tiny", "prompt": "\xff\xfe"', b"\xff\xfe\x00", b""):
        r = httpx.post(url, content=raw, headers=headers)
        assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(url, content=b"x" * (9 << 20), headers=headers)
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
    assert httpx.get(router_cluster["url"] + "/health").json()["status"] == "ok"  # and it stays healthy


def test_models_and_health(client, router_cluster):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(router_cluster["url"] + "/health").json()["workers"] == 2


def test_client_disconnect_frees_both_workers(router_cluster):
    prompt = "a long story about the sea " * 6
    p, d, router = router_cluster["p"], router_cluster["d"], router_cluster["router"]

    def cancelled() -> float:
        return router.metrics.registry.get_sample_value("pdserve_requests_total", {"outcome": "cancelled"}) or 0.0
    cancelled_before, aborted_before = cancelled(), d.worker.stats().requests_aborted
    with HeldAtToken(d.worker, num_tokens=8) as held:
        with httpx.stream("POST", router_cluster["url"] + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0,
                                "stream": True, "ignore_eos": True}) as r:
            assert held.reached.wait(30), "decode never reached the request's 8th token"
            assert next(line for line in r.iter_lines() if line).startswith("data: {")  # text came
        # the client is gone while decode cannot run on: only an abort can end the request early
        assert held.aborts.wait(30), "the router never had the decode worker abort the request its client left"
    wait_for(lambda: p.is_idle() and d.is_idle(), 30, "both workers idle",
             state=lambda: (p.worker.stats(), d.worker.stats()))
    assert held.request.status == RequestStatus.FINISHED_ABORTED
    assert len(held.request.output_token_ids) == held.num_tokens + 1  # of 400
    assert d.worker.stats().requests_aborted == aborted_before + 1
    assert router.admission.requests == 0
    wait_for(lambda: cancelled() == cancelled_before + 1, 10, "the request counted as cancelled",
             state=lambda: cancelled())


def test_overload_gets_429_and_every_admitted_request_completes(router_cluster):
    import concurrent.futures

    import threading

    router = router_cluster["router"]
    router.admission.max_requests = 2
    held, done = [], threading.Event()

    def watch():  # what the router holds stays within its bound however many clients push
        while not done.is_set():
            held.append((router.admission.requests, len(router.live)))
            time.sleep(0.002)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        def one(i):
            return httpx.post(router_cluster["url"] + "/v1/completions", timeout=60,
                              json={"model": MODEL, "prompt": f"request {i} " * 5, "max_tokens": 16, "temperature": 0,
                                    "ignore_eos": True})
        with concurrent.futures.ThreadPoolExecutor(40) as pool:  # 20x what the router admits
            results = list(pool.map(one, range(40)))
    finally:
        done.set()
        watcher.join()
        router.admission.max_requests = 1024
    assert max(h for h, _ in held) <= 2 and max(n for _, n in held) <= 2
    codes = [r.status_code for r in results]
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes
    for r in results:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 16
        else:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
    assert router.admission.requests == 0 and router.admission.tokens == 0


def test_api_key(tiny_llama):
    with RouterServer(tiny_llama, max_model_len=64, api_key="sk-local") as rs:
        r = httpx.post(rs.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(rs.url + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                       headers={"Authorization": "Bearer sk-local"})
        assert r.status_code == 503  # the key is right; no worker lives
        assert r.json()["error"]["type"] == "service_unavailable" and r.headers["retry-after"] == "1"


def test_metrics(client, router_cluster):
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, stream=True))

    def scrape() -> dict[str, float]:
        text = httpx.get(router_cluster["url"] + "/metrics").text
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                if line and not line.startswith("#")}
    # KV bytes come with the workers' next heartbeats
    wait_for(lambda: scrape()["pdserve_kv_bytes_received"] > 0, 10, "the KV bytes in a heartbeat", interval=0.1)
    values = scrape()
    assert values["pdserve_ttft_seconds_count"] >= 2 and values["pdserve_e2e_seconds_count"] >= 2
    assert values['pdserve_requests_total{outcome="ok"}'] >= 2
    assert values["pdserve_generated_tokens_total"] >= 12 and values["pdserve_disaggregated_requests_total"] >= 1
    assert values['pdserve_workers{role="decode"}'] == 1 and values['pdserve_workers{role="prefill"}'] == 1
    assert values["pdserve_queue_requests"] == 0 and values["pdserve_kv_bytes_received"] > 0
    assert 'pdserve_sla_target_seconds{metric="ttft"}' in values
    for phase in ("queue", "prefill", "transfer", "decode"):
        assert values[f'pdserve_phase_seconds_count{{phase="{phase}"}}'] >= 2
    assert values['pdserve_phase_seconds_sum{phase="transfer"}'] > 0  # a prompt's KV came from the prefill worker
    # the articles' indicators (tests/router/test_indicators.py): each a series, in range, on a live cluster
    for name in ('pdserve_sla_attainment{metric="ttft"}', 'pdserve_sla_attainment{metric="both"}',
                 "pdserve_kv_transfer_ttft_share", "pdserve_decode_waiting_share",
                 'pdserve_pool_utilization{role="decode"}', "pdserve_pool_utilization_spread"):
        assert 0.0 <= values[name] <= 1.0, name


def test_a_decode_worker_that_fails_before_the_first_token_is_retried_elsewhere(client, router_cluster, offline):
    from pdserve.router.policy import WorkerLoad

    router, members = router_cluster["router"], router_cluster["members"]
    members[1].stop()  # the real decode worker's heartbeats pause, and it is made to look busy ...
    real = next(w for w in router.registry.workers("decode"))
    real.load = WorkerLoad(running=40, waiting=50, kv_blocks_total=100)
    # ... so an idle-looking worker where nothing listens is the policy's first choice
    dead = router.registry.register("http://127.0.0.1:9", "decode", router.registry.model_hash)
    try:
        out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0)
        assert out.choices[0].text == offline_text(offline, PROMPTS[0], 5)
        assert router.registry.get(dead.worker_id) is None  # dropped at its first failure
    finally:
        d = router_cluster["d"]
        members[1] = RouterMembership(router_cluster["url"], d.url, "decode", d.worker.layout.model_hash,
                                      d.worker.stats).start()


def test_sse_keepalive_while_the_request_waits(router_cluster):
    router, d = router_cluster["router"], router_cluster["d"]
    router.config.keepalive_s = 0.05
    hold = __import__("threading").Event()
    d.worker.loop.call(lambda: hold.wait(10))  # the decode worker is busy for a while
    try:
        lines = []
        with httpx.stream("POST", router_cluster["url"] + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": "wait for me", "max_tokens": 3, "temperature": 0, "stream": True}) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if line == ": keep-alive":
                    hold.set()
        assert ": keep-alive" in lines and lines[-1] == "data: [DONE]"
        assert any(line.startswith("data: {") for line in lines)
    finally:
        hold.set()
        router.config.keepalive_s = 5.0


def test_a_chat_prompt_that_fills_the_context_is_refused(router_cluster):
    r = httpx.post(router_cluster["url"] + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "word " * 5000}]})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "suffix", "the end"),
    ("/v1/completions", "best_of", 3),
])
def test_a_field_not_served_yet_is_refused_by_name_not_ignored(router_cluster, path, field, value):
    body = {"model": MODEL, "max_tokens": 2, field: value}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    r = httpx.post(router_cluster["url"] + path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("neutral", [{"response_format": {"type": "text"}}, {"tools": []}, {"tool_choice": "none"},
                                     {"logprobs": False}, {"top_logprobs": 0}, {"user": "u-1", "store": False,
                                     "metadata": {"k": "v"}, "service_tier": "auto", "parallel_tool_calls": True}])
def test_fields_clients_send_by_default_are_served_or_ignored(client, neutral):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body=neutral)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_echo_with_logprobs_scores_the_prompt_as_the_engine_does(client, offline, router_cluster):
    """What lm-evaluation-harness asks to score a continuation: the prompt's tokens' log-probabilities
    (the first has none), computed by the decode worker (they come with the first token)."""
    tok = offline.get_tokenizer()
    prompt = "scored as a whole: the context, then the continuation to score"
    ids = tok.encode(prompt)
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, logprobs=1)
    want = offline.generate({"prompt_token_ids": ids}, sp)[0]
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True,
                                      stream=stream)
        if stream:
            chunks = [c.choices[0] for c in r if c.choices]
            text = "".join(c.text for c in chunks)
            lp = {k: [v for c in chunks for v in getattr(c.logprobs, k)] for k in ("tokens", "token_logprobs")}
        else:
            text, lp = r.choices[0].text, {k: getattr(r.choices[0].logprobs, k) for k in ("tokens", "token_logprobs")}
        assert text == prompt + want.outputs[0].text
        assert lp["tokens"][: len(ids)] == [tok.decode([t]) for t in ids] and lp["token_logprobs"][0] is None
        expected = [e.logprob for e in want.prompt_logprobs[1:]] + [want.outputs[0].logprobs[0].logprob]
        assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None


def test_structured_outputs_with_the_openai_client(client, offline, router_cluster):
    """`parse` with a pydantic model returns the parsed object; vLLM's `structured_outputs` and
    `guided_*` fields are served too, each answer inside its structure (the long prompt goes
    through the prefill worker, whose first token obeys it)."""
    import re
    from typing import Literal

    from pydantic import BaseModel

    class Answer(BaseModel):
        ok: bool
        level: Literal["low", "high"]

    messages = [{"role": "user", "content": "answer as JSON, please, with ok and level"}]
    parsed = client.chat.completions.parse(model=MODEL, messages=messages, response_format=Answer, max_tokens=40,
                                           temperature=0).choices[0].message.parsed
    assert isinstance(parsed, Answer)
    for extra, check in ((dict(structured_outputs={"choice": ["red", "green", "blue"]}), lambda t: t in ("red", "green", "blue")),
                         (dict(guided_regex=r"[0-9]{2}:[0-9]{2}"), lambda t: re.fullmatch(r"[0-9]{2}:[0-9]{2}", t)),
                         (dict(response_format={"type": "json_object"}), lambda t: isinstance(json.loads(t), dict))):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=40, temperature=0, extra_body=extra)
        assert check(r.choices[0].text), (extra, r.choices[0].text)


DEEP: list = [1]
for _ in range(40):
    DEEP = [DEEP]


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                          "properties": 5}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"guided_json": {"a": DEEP}}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, None),
])
def test_a_structure_that_cannot_be_built_is_a_400_before_admission(router_cluster, body, param):
    r = httpx.post(router_cluster["url"] + "/v1/completions", json={"model": MODEL, "prompt": "x", **body})
    assert r.status_code == 400, r.text
    if param is not None:
        assert param in (r.json()["error"]["param"] or "") + r.json()["error"]["message"], r.text


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
                   "required": ["city", "celsius"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(params=list(FORMATS))
def tool_format(request, router_cluster):
    """The router writing and reading tool calls in each format, as `--tool-call-parser` sets it."""
    router = router_cluster["router"]
    kept = router.tool_calls
    router.tool_calls = ToolCalls(FORMATS[request.param], router.tokenizer)
    yield request.param
    router.tool_calls = kept


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_tool_call_round_trip(client, tool_format, stream, choice):
    """The model calls (forced: its arguments match the function's schema, so they parse), the
    client answers with a `tool` message, and the model replies; in each format, streamed as
    argument deltas or not."""
    messages = [{"role": "user", "content": "what time is it in Paris? use a tool"}]
    asked = dict(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=300,
                 temperature=0)
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(**asked, stream=True):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": "", "pieces": 0})
                    calls[d.index]["arguments"] += d.function.arguments or ""
                    calls[d.index]["pieces"] += bool(d.function.arguments)
        (call,) = calls.values()
        assert call["pieces"] > 1  # the arguments came as the model wrote them, not at the end
    else:
        r = client.chat.completions.create(**asked)
        finish = r.choices[0].finish_reason
        (tc,) = r.choices[0].message.tool_calls
        call = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
    assert finish == "tool_calls"
    args = json.loads(call["arguments"])
    if choice == "required":
        assert call["name"] in ("get_weather", "get_time")
    else:
        assert call["name"] == "get_time" and args["zone"] in ("UTC", "CET")
    reply = client.chat.completions.create(model=MODEL, max_tokens=5, temperature=0, tools=[WEATHER, CLOCK], messages=[
        *messages, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "12:00"}])
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].finish_reason in ("length", "stop")


def test_tools_are_refused_where_they_cannot_be_served(router_cluster):
    url = router_cluster["url"]
    for path, body, param in (
            ("/v1/completions", {"prompt": "x", "tools": [WEATHER]}, "tools"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                                      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, None),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
             "functions")):
        r = httpx.post(url + path, json={"model": MODEL, "max_tokens": 2, **body})
        assert r.status_code == 400, r.text
        assert param is None or r.json()["error"]["param"] == param


def test_two_completions_each_get_their_own_logprobs_structure_and_echo(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=2, max_tokens=12, temperature=1.0, seed=9,
                                  logprobs=1, echo=True, extra_body={"structured_outputs": {"regex": "[a-z]{4}"}})
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        assert c.text.startswith(PROMPTS[0]) and re.fullmatch("[a-z]{4}", c.text[len(PROMPTS[0]):])
        assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == len(c.logprobs.token_logprobs)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                                 max_tokens=12, temperature=1.0, seed=9, logprobs=True, stream=True,
                                                 extra_body={"structured_outputs": {"choice": ["up", "down"]}}))
    for index in (0, 1):
        mine = [c for chunk in chunks for c in chunk.choices if c.index == index]
        text = "".join(c.delta.content or "" for c in mine)
        entries = [e for c in mine if c.logprobs for e in c.logprobs.content]
        assert text in ("up", "down") and "".join(e.token for e in entries) == text


def test_several_prompts_in_one_request_are_each_answered(client, offline):
    prompts = [PROMPTS[0], "another prompt, with its own answer"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0)
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    assert [by_index[i] for i in range(4)] == [offline_text(offline, p, 6) for p in prompts for _ in range(2)]
    tok = offline.get_tokenizer()
    ids = client.completions.create(model=MODEL, prompt=[tok.encode(p) for p in prompts], max_tokens=6, temperature=0)
    assert [c.text for c in sorted(ids.choices, key=lambda c: c.index)] == [offline_text(offline, p, 6) for p in prompts]
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    for one in ([prompts[0]], [tok.encode(prompts[0])]):  # a list of one prompt, as lm-evaluation-harness sends
        (choice,) = client.completions.create(model=MODEL, prompt=one, max_tokens=6, temperature=0).choices
        assert choice.text == offline_text(offline, prompts[0], 6)
    with pytest.raises(openai.BadRequestError, match="several prompts"):
        client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, stream=True)
    with pytest.raises(openai.BadRequestError, match="prompt token ids"):  # one bad prompt fails them all
        client.completions.create(model=MODEL, prompt=[tok.encode(prompts[0]), [10**6]], max_tokens=2)
