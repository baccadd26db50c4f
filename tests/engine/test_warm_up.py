"""An engine warms up before serving: one prompt of a full step and a block more through the model,
its output dropped, nothing held afterwards, and later requests answered as they would have been."""

from __future__ import annotations

import pytest

from pdserve import SamplingParams
from tests.factories import assert_engine_idle, make_llm


def test_warming_up_leaves_the_engine_idle_and_its_answers_unchanged(tiny_llama):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 2, 7, 11, 3]}
    cold = make_llm(tiny_llama, max_num_batched_tokens=16)
    expected = cold.generate([prompt], params)[0].outputs[0].token_ids

    warm = make_llm(tiny_llama, max_num_batched_tokens=16)
    assert warm.engine.warm_up() > 0
    assert_engine_idle(warm)
    assert warm.generate([prompt], params)[0].outputs[0].token_ids == expected
    assert_engine_idle(warm)


def test_warming_up_a_busy_engine_is_refused(tiny_llama):
    llm = make_llm(tiny_llama)
    llm.engine.add_request(None, {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        llm.engine.warm_up()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_warming_up_runs_each_matmul_at_every_row_count_its_kernels_pad_to(tiny_llama, monkeypatch, dtype):
    from pdserve.layers import linear as linear_module
    from pdserve.layers.packed import row_counts

    llm = make_llm(tiny_llama, dtype=dtype, max_num_batched_tokens=40, max_num_seqs=5)
    seen: dict[int, list[int]] = {}
    real = linear_module.linear

    def counting(x, weight, bias=None):
        seen.setdefault(id(weight), []).append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(linear_module, "linear", counting)
    llm.engine.warm_up()
    model = llm.engine.runner.model
    for weight, _, most in model.products(40, 5):
        if weight.is_mkldnn:  # bfloat16 where oneDNN packs it
            assert seen[id(weight)] == row_counts(most)
        else:  # plain weights (float32; bfloat16 on an AVX2-only CPU): one kernel serves every count
            assert id(weight) not in seen
