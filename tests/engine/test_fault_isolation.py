"""A request that breaks a step fails alone: its batch mates go on with exactly the tokens they
would have produced without it (seeded ones included), and no block is left behind."""

from __future__ import annotations

import pytest

from pdserve import SamplingParams
from pdserve.limits import SEED_LIMIT
from tests.factories import FailingSampler, assert_engine_idle, make_llm

PROMPTS = [{"prompt_token_ids": [(i * 13 + k) % 400 + 5 for k in range(9 + 3 * i)]} for i in range(3)]
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=1234, max_tokens=6, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def llm(tiny_llama):
    return make_llm(tiny_llama)


def run_all(llm, ids: list[str]) -> dict[str, object]:
    finals = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                finals[out.request_id] = out
    return {i: finals[i] for i in ids}


def test_a_request_that_breaks_the_step_fails_alone(llm):
    params = [SEEDED, GREEDY, SEEDED]
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        llm.engine.add_request(f"clean-{i}", prompt, p)
    expected = {k: v.outputs[0].token_ids for k, v in run_all(llm, [f"clean-{i}" for i in range(3)]).items()}

    llm.engine.runner.sample = FailingSampler(llm.engine.runner.sample, "bad")
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        llm.engine.add_request(f"clean-{i}", prompt, p)
        if i == 1:
            llm.engine.add_request("bad", PROMPTS[0], GREEDY)
    outs = run_all(llm, ["bad", "clean-0", "clean-1", "clean-2"])

    assert outs["bad"].outputs[0].finish_reason == "error" and outs["bad"].finished
    for i in range(3):
        assert outs[f"clean-{i}"].outputs[0].token_ids == expected[f"clean-{i}"]
        assert outs[f"clean-{i}"].outputs[0].finish_reason == "length"
    assert_engine_idle(llm)


def test_all_completions_of_a_failing_request_end_with_it(llm):
    llm.engine.runner.sample = FailingSampler(llm.engine.runner.sample, "bad#1")
    llm.engine.add_request("bad", PROMPTS[1], GREEDY.clone(n=3))
    llm.engine.add_request("good", PROMPTS[2], GREEDY)
    outs = run_all(llm, ["bad", "good"])
    assert [c.finish_reason for c in outs["bad"].outputs] == ["error"] * 3
    assert outs["good"].outputs[0].finish_reason == "length" and len(outs["good"].outputs[0].token_ids) == 6
    assert_engine_idle(llm)


def test_a_request_whose_text_fails_ends_alone(llm, monkeypatch):
    llm.engine.add_request("bad", PROMPTS[0], GREEDY)
    llm.engine.add_request("good", PROMPTS[1], GREEDY)
    _, seq = llm.engine._sequences["bad"]

    def broken(token: int) -> None:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "broken tokenizer")
    monkeypatch.setattr(seq.detokenizer, "add", broken)
    outs = run_all(llm, ["bad", "good"])
    assert outs["bad"].outputs[0].finish_reason == "error"
    assert outs["good"].outputs[0].finish_reason == "length"
    assert_engine_idle(llm)


def test_n_completions_with_the_largest_seed(llm):
    """The n children's seeds wrap within the documented range instead of overflowing the generator."""
    params = SamplingParams(n=2, temperature=1.0, seed=SEED_LIMIT - 1, max_tokens=4, ignore_eos=True)
    out = llm.generate(PROMPTS[0], params)[0]
    assert [c.finish_reason for c in out.outputs] == ["length", "length"]
    again = llm.generate(PROMPTS[0], params.clone(n=1, seed=0))[0]  # child 1 has seed (2^63 - 1 + 1) mod 2^63
    assert out.outputs[1].token_ids == again.outputs[0].token_ids
    assert_engine_idle(llm)


def test_a_request_is_queued_whole_or_not_at_all(llm):
    llm.engine.add_request("x#1", PROMPTS[0], GREEDY)  # takes the id of the second completion of "x"
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request("x", PROMPTS[1], GREEDY.clone(n=2))
    assert "x" not in llm.engine.request_ids()
    assert set(llm.engine.scheduler.requests) == {"x#1"}
    outs = run_all(llm, ["x#1"])
    assert outs["x#1"].outputs[0].finish_reason == "length"
    assert_engine_idle(llm)


@pytest.mark.parametrize("priority", [True, 1.5, 1 << 40, "0"])
def test_priority_is_bounded(llm, priority):
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.engine.add_request("p", PROMPTS[0], GREEDY, priority=priority)
    assert_engine_idle(llm)


def test_an_engine_thread_whose_cores_cannot_be_pinned_runs_unpinned(llm, monkeypatch):
    from pdserve.worker import engine_loop

    def refuse() -> bool:
        raise OSError("this host refuses CPU affinity")

    monkeypatch.setattr(engine_loop, "bind_team_to_cores", refuse)
    loop = engine_loop.EngineLoop(llm.engine)
    loop.start()
    try:
        tokens = loop.call_and_wait(lambda: llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids)
        assert loop.alive and len(tokens) == 6
    finally:
        loop.stop()
    assert_engine_idle(llm)
