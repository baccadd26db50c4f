"""Mixture-of-experts models beyond what the transformers comparisons cover: the experts' layouts
on disk, which layers route, what is counted, what is refused, and quantized experts."""

import json

import pytest
import torch

from pdserve.models.arch_config import ArchConfig
from pdserve.models.checkpoint import load_hf_dir
from pdserve.models.mlp import SparseMoE
from tests.factories import make_llm, paged_logits


def test_stacked_experts_load_like_one_tensor_per_expert(tiny_models, tmp_path):
    """transformers 5 holds experts stacked ([experts, 2 * intermediate, hidden]); a checkpoint
    saved that way gives the same logits as the released per-expert one."""
    ckpt = load_hf_dir(tiny_models["qwen3_moe"])
    t = ckpt.tensors
    cfg = ArchConfig.from_hf_config(ckpt.hf_config)  # transformers 5 writes num_local_experts here
    count = cfg.experts.count
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        t[p + "gate_up_proj"] = torch.stack([torch.cat([t.pop(f"{p}{j}.gate_proj.weight"),
                                                        t.pop(f"{p}{j}.up_proj.weight")]) for j in range(count)])
        t[p + "down_proj"] = torch.stack([t.pop(f"{p}{j}.down_proj.weight") for j in range(count)])
    ckpt.save(tmp_path / "stacked")
    prompt = list(range(3, 40))
    a, _ = paged_logits(make_llm(tiny_models["qwen3_moe"]), prompt, num_decode_steps=3)
    b, _ = paged_logits(make_llm(tmp_path / "stacked"), prompt, num_decode_steps=3)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_which_layers_route(tiny_models):
    cfg = ArchConfig.from_hf_config(json.loads((tiny_models["qwen2_moe"] / "config.json").read_text()))
    assert cfg.experts.dense_layers == (0,)  # mlp_only_layers
    assert not cfg.sparse(0) and cfg.sparse(1)
    model = make_llm(tiny_models["qwen2_moe"]).engine.runner.model
    assert not isinstance(model.layers[0].mlp, SparseMoE) and isinstance(model.layers[1].mlp, SparseMoE)
    every_other = dict(json.loads((tiny_models["qwen2_moe"] / "config.json").read_text()),
                       decoder_sparse_step=2, mlp_only_layers=[], num_hidden_layers=4)
    assert ArchConfig.from_hf_config(every_other).experts.dense_layers == (0, 2)


def test_parameters_counted_all_and_active(tiny_models):
    """`num_parameters` counts what the checkpoint holds; `active=True` what one token computes with."""
    for variant in ("mixtral", "qwen2_moe", "qwen3_moe"):
        ckpt = load_hf_dir(tiny_models[variant])
        cfg = ArchConfig.from_hf_config(ckpt.hf_config)
        assert cfg.num_parameters() == sum(t.numel() for t in ckpt.tensors.values())
        e = cfg.experts
        unrouted = (e.count - e.per_token) * 3 * cfg.hidden_size * e.intermediate_size
        assert cfg.num_parameters() - cfg.num_parameters(active=True) == unrouted * (cfg.num_layers - len(e.dense_layers))


def test_unsupported_settings_are_refused(tiny_models):
    base = json.loads((tiny_models["qwen2_moe"] / "config.json").read_text())
    with pytest.raises(ValueError, match="use_sliding_window"):
        ArchConfig.from_hf_config(dict(base, use_sliding_window=True))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ArchConfig.from_hf_config(dict(base, num_experts_per_tok=7))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_experts_quantize_like_any_weight(tiny_models, quantization):
    """Each expert's products go through the quantized kernels; the first greedy token agrees with
    float32 (random weights: later tokens drift with any change of precision)."""
    prompt = list(range(3, 40))
    exact, _ = paged_logits(make_llm(tiny_models["mixtral"]), prompt, num_decode_steps=0)
    llm = make_llm(tiny_models["mixtral"], dtype="bfloat16", quantization=quantization)
    expert = llm.engine.runner.model.layers[0].mlp.experts[0]
    assert type(expert.gate_up_proj).__name__ == "QuantizedWeight"
    quantized, _ = paged_logits(llm, prompt, num_decode_steps=0)
    assert int(quantized[0].argmax()) == int(exact[0].argmax())
