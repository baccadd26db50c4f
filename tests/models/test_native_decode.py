"""A decode step's layers in one kernel call: the same hidden states as the model's modules, bit
for bit, wherever it runs; the model's modules wherever it cannot."""

import pytest
import torch

from pdserve import SamplingParams
from pdserve.layers.kernels import native
from pdserve.layers.quant import DenseProducts
from tests.factories import assert_engine_idle, kernel_isa_params, make_llm

pytestmark = pytest.mark.skipif(native.load() is None, reason="pdserve's CPU kernels do not build here")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2], [9, 9, 8]]


def _steps(llm, prompts: list[list[int]], decode_steps: int) -> tuple[list[torch.Tensor], int]:
    """Every decode step's final hidden states (greedy), and how many steps ran the stack."""
    engine, model = llm.engine, llm.engine.runner.model
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True))
    hidden, stacked = [], [0]
    forward, stack = model.forward, model.decode_stack()

    def recording(input_ids, positions, kv_caches, meta, on_layer=None):
        out = forward(input_ids, positions, kv_caches, meta, on_layer)
        if not meta.prefills:
            hidden.append(out.clone())
            stacked[0] += stack is not None and model.use_decode_stack and stack.takes(out, meta)
        return out

    model.forward = recording
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        model.forward = forward
    assert_engine_idle(llm)
    return hidden, stacked[0]


def assert_stack_as_modules(llm, prompts: list[list[int]], decode_steps: int) -> None:
    """Every decode step runs the stack, and gives the hidden states the modules give, bit for bit."""
    model = llm.engine.runner.model
    model.use_decode_stack = False
    modules, none = _steps(llm, prompts, decode_steps)
    model.use_decode_stack = True
    stacked, count = _steps(llm, prompts, decode_steps)
    assert none == 0 and count == len(stacked) == len(modules) == decode_steps
    for a, b in zip(modules, stacked):
        assert torch.equal(a, b)


# GQA; one KV head; q/k/v biases; q/k norms; Gemma 3 (sliding windows, local rotary tables, output norms, GELU)
@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_stack_gives_the_modules_hidden_states_bit_for_bit(tiny_models, variant, dtype, rows):
    llm = make_llm(tiny_models[variant], dtype=dtype, quantization="int4", enable_prefix_caching=False)
    model = llm.engine.runner.model
    model.layers[0].mlp.down_proj.dense.min_rows = None  # every product on the quantized kernels
    assert_stack_as_modules(llm, PROMPTS[:rows], 4)


# AMX tiles (bfloat16 rows), and panels of 4- and 8-bit weights in either dtype
@pytest.mark.parametrize("on,bits,dtype", [("tiles", 8, "bfloat16"), ("panels", 4, "float32"),
                                           ("panels", 4, "bfloat16"), ("panels", 8, "float32"),
                                           ("panels", 8, "bfloat16")])
def test_the_stack_runs_batch_products_where_the_model_would(tiny_llama, on, bits, dtype):
    kernels = native.load()
    if on == "tiles" and not kernels.qmatmul_amx_available:
        pytest.skip("quantized products on AMX tiles: this CPU (or build) has no AMX with AVX-512 BF16")
    if on == "panels" and not kernels.panels_available(bits):
        pytest.skip(f"{bits}-bit products on panels: this CPU (or build) has no {'AVX2' if bits == 4 else 'VNNI'}")
    llm = make_llm(tiny_llama, dtype=dtype, quantization=f"int{bits}", enable_prefix_caching=False)
    model = llm.engine.runner.model
    dense = model.layers[0].mlp.down_proj.dense
    dense.tile_rows, dense.panel_rows = (2, None) if on == "tiles" else (None, 2)
    dense.min_rows = None
    if on == "panels":
        assert all(w.panels is not None for w in (model.layers[0].mlp.gate_up_proj, model.layers[0].mlp.down_proj))
    assert_stack_as_modules(llm, PROMPTS, 3)


def test_the_modules_run_where_the_stack_cannot(tiny_models):
    # routed experts, and weights not quantized: no stack at all
    assert make_llm(tiny_models["qwen3_moe"], quantization="int4").engine.runner.model.decode_stack() is None
    assert make_llm(tiny_models["llama"]).engine.runner.model.decode_stack() is None
    # dense products at this many rows: the modules run the step
    llm = make_llm(tiny_models["llama"], quantization="int4", enable_prefix_caching=False)
    llm.engine.runner.model.layers[0].mlp.down_proj.dense.min_rows = 2
    hidden, count = _steps(llm, PROMPTS[:2], 2)
    assert hidden and count == 0
    # the shared settings object is the one the stack reads
    assert isinstance(llm.engine.runner.model.decode_stack().dense, DenseProducts)


@pytest.mark.parametrize("isa", kernel_isa_params())
def test_every_kernel_variant_runs_the_stack_as_the_modules_do(tiny_llama, isa):
    """The stack calls the variant the step's kernels name: forced to each one this CPU runs
    (the AVX2 and portable ones included), it still gives the modules' hidden states."""
    llm = make_llm(tiny_llama, dtype="bfloat16", quantization="int4", enable_prefix_caching=False)
    runner = llm.engine.runner
    runner.kernels = native.load().with_isa(isa)
    dense = runner.model.layers[0].mlp.down_proj.dense
    dense.tile_rows = dense.panel_rows = None  # AMX tiles and panels only with the AVX-512 variant
    runner.model.layers[0].mlp.down_proj.dense.min_rows = None
    assert_stack_as_modules(llm, PROMPTS[:2], 3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_stack_runs_a_gguf_files_blocks_as_the_modules_do(tiny_llama, tmp_path, dtype):
    """A file's weights in block formats (a fused q/k/v of two formats in three parts, gate and up of one,
    Q4_1 held as a 4-bit `QuantizedWeight`) run in the stack part by part, bit for bit."""
    from gguf import GGMLQuantizationType as T

    from pdserve.layers.block_weight import BlockWeight
    from pdserve.layers.quant import QuantizedWeight
    from tests.gguf_files import write_llama_gguf

    quant = {}
    for i in range(2):
        quant |= {f"blk.{i}.attn_q.weight": T.Q8_0, f"blk.{i}.attn_k.weight": T.Q5_0, f"blk.{i}.attn_v.weight": T.Q5_0,
                  f"blk.{i}.attn_output.weight": T.Q4_1, f"blk.{i}.ffn_gate.weight": T.Q4_0,
                  f"blk.{i}.ffn_up.weight": T.Q4_0, f"blk.{i}.ffn_down.weight": T.Q5_1}
    write_llama_gguf(tiny_llama, tmp_path / "tiny.gguf", quant)
    llm = make_llm(tmp_path / "tiny.gguf", dtype=dtype, quantization="auto", enable_prefix_caching=False)
    model = llm.engine.runner.model
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, BlockWeight) and len(layer.self_attn.qkv_proj.parts) == 3
    assert isinstance(layer.self_attn.o_proj, QuantizedWeight) and isinstance(layer.mlp.down_proj, BlockWeight)
    for d in model.decode_stack().denses:
        d.min_rows = None  # every product on the blocks
    assert_stack_as_modules(llm, PROMPTS[:3], 3)


def test_the_stack_runs_block_weights_on_amx_tiles_as_the_modules_do(tiny_llama, tmp_path):
    """Block weights' products of a bfloat16 decode batch on AMX tiles, in the stack and in the
    modules alike: the same hidden states, bit for bit."""
    from gguf import GGMLQuantizationType as T

    from tests.gguf_files import write_llama_gguf

    if not native.load().qmatmul_amx_available:
        pytest.skip("this CPU (or build) has no AMX with AVX-512 BF16")
    quant = {f"blk.{i}.{name}.weight": T.Q5_0 for i in range(2)
             for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    write_llama_gguf(tiny_llama, tmp_path / "tiny.gguf", quant)
    llm = make_llm(tmp_path / "tiny.gguf", dtype="bfloat16", enable_prefix_caching=False)
    model = llm.engine.runner.model
    blocks = model.layers[0].mlp.down_proj.dense
    blocks.tile_rows, blocks.min_rows = 2, None
    assert_stack_as_modules(llm, PROMPTS, 3)
