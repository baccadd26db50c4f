"""What each step's output carries: what is new since the last one; the request's final output
also each completion whole, equal to its deltas put together (n = 1 and n = 2, stop strings)."""

from __future__ import annotations

import pytest

from pdserve import SamplingParams
from tests.factories import assert_engine_idle, make_llm


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=7, ignore_eos=True),
])
def test_outputs_are_deltas_and_the_final_one_is_whole(tiny_llama, params):
    llm = make_llm(tiny_llama)
    llm.engine.add_request("r", "the model token prefill", params)
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs += llm.engine.step()
    *running, final = outputs
    assert final.finished and not any(o.finished for o in running) and running
    for out in running:
        assert all(c.token_ids == [] and c.text == "" for c in out.outputs)
    for c in final.outputs:
        deltas = [d for out in outputs for d in out.outputs if d.index == c.index]
        assert [t for d in deltas for t in d.delta_token_ids] == c.token_ids and len(c.token_ids) == params.max_tokens
        assert "".join(d.delta_text for d in deltas) == c.text
    assert_engine_idle(llm)
