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


@pytest.mark.parametrize("on", ["tiles", "panels"])
def test_warming_up_settles_where_decode_batches_turn_dense_from_whole_steps(tiny_llama, caplog, on):
    from pdserve.layers.kernels import native

    kernels = native.load()
    if on == "tiles" and (kernels is None or not kernels.qmatmul_amx_available):
        pytest.skip("quantized products on AMX tiles: this CPU (or build) has no AMX with AVX-512 BF16")
    if on == "panels" and (kernels is None or not kernels.panels_available(4)):
        pytest.skip("4-bit products on panels: this CPU (or build) has no AVX2")
    llm = make_llm(tiny_llama, dtype="bfloat16", quantization="int4", max_num_seqs=8)
    model = llm.engine.runner.model
    dense = model.decode_stack().dense
    # as a calibration may leave them: dense from the first count the batch kernel serves
    dense.tile_rows, dense.panel_rows = (2, None) if on == "tiles" else (None, 2)
    dense.min_rows = 2
    with caplog.at_level("INFO", logger="pdserve.engine"):
        llm.engine.warm_up()
    # timed, both ways, at 2, 4 and 8 rows until the dense steps won; measured now, so any
    # doubling (or 9: tiles at every count up to the engine's most sequences) is a valid answer
    assert dense.min_rows in (2, 4, 8, 9)
    assert "decode steps of 2 rows" in caplog.text and ("AMX tiles" if on == "tiles" else "on panels") in caplog.text
    assert_engine_idle(llm)
    assert llm.engine.num_aborted == 0 and llm.engine.num_failed == 0


def test_a_model_without_the_decode_stack_keeps_its_calibration(tiny_models):
    from pdserve.engine.decode_products import settle_dense_rows

    qwen3 = make_llm(tiny_models["qwen3"], dtype="bfloat16", quantization="int4")  # q/k norms: no stack
    before = qwen3.engine.runner.model.layers[0].mlp.down_proj.dense.min_rows
    settle_dense_rows(qwen3.engine)
    assert qwen3.engine.runner.model.layers[0].mlp.down_proj.dense.min_rows == before
    assert not qwen3.engine.has_unfinished_requests()


def test_a_calibration_past_the_tiles_reach_is_kept_untimed(monkeypatch):
    from types import SimpleNamespace

    import torch

    from pdserve.engine import decode_products
    from pdserve.layers.quant import DenseProducts

    dense = DenseProducts(min_rows=128, tile_rows=8)  # dense only from 128 rows: beyond one expansion's 64
    stack = SimpleNamespace(dense=dense)
    model = SimpleNamespace(decode_stack=lambda: stack)
    engine = SimpleNamespace(runner=SimpleNamespace(model=model, kernels=object()), dtype=torch.bfloat16,
                             config=SimpleNamespace(max_num_seqs=64))
    monkeypatch.setattr(decode_products, "_decode_seconds", lambda *a: pytest.fail("timed"))
    decode_products.settle_dense_rows(engine)
    assert dense.min_rows == 128  # never moved earlier than the products' own timing put it
