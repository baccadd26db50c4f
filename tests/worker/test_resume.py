"""Resuming a request that another worker began (`output_token_ids`): the continuation equals the
uninterrupted output, for greedy and seeded sampling, colocated and with the KV coming from
another worker — a decode worker included, which is how the router migrates a running request."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from pdserve import SamplingParams
from tests.factories import every_draft_verified, make_llm
from tests.worker.cluster import Cluster, WorkerServer, prompt

SAMPLINGS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 77},
             # counted from every token so far, those generated before the resume included
             "penalized": {"temperature": 0.8, "seed": 5, "frequency_penalty": 1.1, "presence_penalty": 0.4,
                           "repetition_penalty": 1.3, "logit_bias": {7: 3.0, 11: -100.0}}}


@pytest.fixture(scope="module")
def colocated(tiny_llama):
    return make_llm(tiny_llama, block_size=4)


def full_output(llm, tokens, max_tokens, **sampling):
    sp = SamplingParams(**{"max_tokens": max_tokens, "ignore_eos": True, **sampling})
    return llm.generate([{"prompt_token_ids": tokens}], sp)[0].outputs[0].token_ids


def resume(llm, tokens, done, max_tokens, **sampling):
    engine = llm.engine
    sp = SamplingParams(**{"max_tokens": max_tokens, "ignore_eos": True, **sampling})
    rid = engine.add_request(None, {"prompt_token_ids": tokens}, sp, output_token_ids=done)
    new, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                new += out.outputs[0].delta_token_ids
                last = out
    return new, last


@pytest.mark.parametrize("kind", SAMPLINGS)
def test_engine_resume_continues_exactly(colocated, kind):
    tokens = prompt(37, seed=2)
    full = full_output(colocated, tokens, 20, **SAMPLINGS[kind])
    for cut in (1, 7, 19):
        new, last = resume(colocated, tokens, full[:cut], 20, **SAMPLINGS[kind])
        assert new == full[cut:]  # nothing repeated, nothing missing, max_tokens counts the resumed ones
        assert last.outputs[0].token_ids == full and last.outputs[0].finish_reason == "length"


def test_engine_resume_refuses_bad_output_ids(colocated):
    engine = colocated.engine
    sp = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="length limit"):
        engine.add_request(None, {"prompt_token_ids": [1, 2, 3]}, sp, output_token_ids=[5, 6, 7, 8])
    with pytest.raises(ValueError, match="must be in"):
        engine.add_request(None, {"prompt_token_ids": [1, 2, 3]}, sp, output_token_ids=[-1])
    with pytest.raises(ValueError, match="n=1"):
        engine.add_request(None, {"prompt_token_ids": [1, 2, 3]}, sp.clone(n=2), output_token_ids=[5])
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("kind", SAMPLINGS)
def test_disaggregated_resume_matches(tiny_llama, colocated, kind):
    tokens = prompt(45, seed=5)
    full = full_output(colocated, tokens, 16, **SAMPLINGS[kind])
    with Cluster(tiny_llama, "tcp") as c:
        body = c.body(tokens, max_tokens=16, **SAMPLINGS[kind])
        body["output_token_ids"] = full[:6]
        r = c.http.post(c.d.url + "/v1/generate", json={**body, "stream": False})
        assert r.status_code == 200, r.text
        assert [t for line in r.json() for t in line["outputs"][0]["token_ids"]] == full[6:]
        stats = c.d.worker.stats()
        assert stats.kv_landed == 1 and stats.kv_recomputed == 0
        c.wait_idle()


def moved(tiny_llama, tokens: list[int], sampling: dict, cut: int, **engine) -> tuple[list[int], list, object, object]:
    """A request run on one decode worker, stopped there after `cut` tokens and continued on another
    that takes its KV from the first one's prefix cache (the router's hot-spot move): (every token,
    every log-probability entry sent, each worker's stats); both workers end idle. `engine`: both
    workers' engine settings."""
    hot = WorkerServer(tiny_llama, "decode", ["tcp"], block_size=8, **engine)
    cool = WorkerServer(tiny_llama, "decode", ["tcp"], block_size=8, **engine)
    for w in (hot, cool):
        every_draft_verified(w.worker.engine)
    try:
        done, entries = [], []
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", hot.url + "/v1/generate",
                             json={"prompt_token_ids": tokens, "sampling": sampling}) as r:
                for line in r.iter_lines():
                    out = json.loads(line)["outputs"][0]
                    done += out["token_ids"]
                    entries += out.get("logprobs") or []
                    if len(done) >= cut:
                        break  # closing the stream aborts the request on `hot`
            r = http.post(cool.url + "/v1/generate", json={
                "prompt_token_ids": tokens, "output_token_ids": done, "sampling": sampling,
                "prefill_url": hot.url, "stream": False})
            assert r.status_code == 200, r.text
            for line in r.json():
                done += line["outputs"][0]["token_ids"]
                entries += line["outputs"][0].get("logprobs") or []
        for w in (hot, cool):  # nothing leaked on either side
            assert w.is_idle()
        return done, entries, hot.worker.stats(), cool.worker.stats()
    finally:
        hot.stop()
        cool.stop()


def test_decode_worker_ships_a_running_requests_kv_to_another(tiny_llama, colocated):
    """The migration path: a request runs on one decode worker, is stopped there, and continues on
    another that takes its KV (prompt and generated tokens) from the first one's prefix cache."""
    tokens = prompt(60, seed=9)
    sampling = {"temperature": 0.8, "seed": 5, "max_tokens": 24, "ignore_eos": True}
    full = full_output(colocated, tokens, **sampling)
    done, _, hot, cool = moved(tiny_llama, tokens, sampling, 9)
    assert done == full
    assert cool.kv_landed == 1 and cool.kv_recomputed == 0 and hot.kv_notified == 1


def test_a_moved_request_keeps_its_structure_and_log_probabilities(tiny_llama, colocated):
    """A request with a structure and log-probabilities moves between decode workers mid-stream
    (the hot-spot relief path): the new worker rebuilds the structure's matcher from the tokens so
    far, and the tokens and their log-probabilities are the uninterrupted ones (float32: the same
    arithmetic on the same KV; 1e-4 allows for a different order of sums in another batch shape)."""
    from pdserve.sampling_params import Structure

    tokens = prompt(50, seed=4)
    regex = "[a-z ]{1,400}"
    offline = colocated.generate([{"prompt_token_ids": tokens}], SamplingParams(
        temperature=0.8, seed=3, max_tokens=20, ignore_eos=True, logprobs=2, structure=Structure("regex", regex)))
    full, full_logprobs = offline[0].outputs[0].token_ids, offline[0].outputs[0].logprobs
    sampling = {"temperature": 0.8, "seed": 3, "max_tokens": 20, "ignore_eos": True, "logprobs": 2,
                "structure": {"kind": "regex", "spec": regex}}
    done, entries, _, cool = moved(tiny_llama, tokens, sampling, 7)
    assert done == full and re.fullmatch(regex, colocated.get_tokenizer().decode(full))
    assert [e[0] for e in entries] == full
    for (token, logprob, top), expected in zip(entries, full_logprobs):
        assert logprob == pytest.approx(expected.logprob, abs=1e-4)
        assert [t for t, _ in top] == [t for t, _ in expected.top]
    assert cool.kv_landed == 1


@pytest.mark.parametrize("sampling", [
    {"temperature": 0, "max_tokens": 48, "ignore_eos": True},
    {"temperature": 0.7, "seed": 8, "max_tokens": 48, "ignore_eos": True, "logit_bias": {"5": 8.0, "6": 8.0}},
], ids=["greedy", "seeded"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_moved_speculating_request_goes_on_as_it_would_have(tiny_llama, colocated, sampling, method):
    """Both decode workers speculate. Prompt lookup needs only the tokens so far, which move with
    the request; a draft model's KV of them moves with the target's (the worker it leaves computes
    it as it ships the target's: the new one computes none). The tokens are the uninterrupted
    ones without speculation, drafts were accepted on both sides of the move, nothing leaks."""
    tokens = prompt(7, seed=3) * 4
    full = full_output(colocated, tokens, **{**sampling, "logit_bias": {int(k): v for k, v in
                                                                        sampling.get("logit_bias", {}).items()}})
    engine = ({"speculative": "ngram"} if method == "ngram"
              else {"speculative": f"draft:{tiny_llama}", "draft_quantization": "int4"})
    done, _, hot, cool = moved(tiny_llama, tokens, sampling, 24, **engine)
    assert done == full
    assert hot.draft_tokens_accepted > 0 and cool.draft_tokens_accepted > 0
    assert cool.kv_landed == 1 and cool.kv_recomputed == 0
    if method == "draft":
        assert cool.draft_prompt_tokens == 0 and hot.draft_prompt_tokens >= 2 * len(tokens) + 24
