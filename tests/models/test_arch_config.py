"""config.json read as transformers reads it: both layouts of the rotary fields, the sliding window,
fields left out; and what transformers would honour that we cannot, refused with a reason.

The reference is the installed transformers itself: its rotary embedding's inverse frequencies, its
config classes' defaults, and the modules it builds (on the meta device: shapes, no weights)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdserve.layers.rotary import inverse_frequencies
from pdserve.models.arch_config import ArchConfig

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}
_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=1024)
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}


def config(model_type: str = "llama", sizes: dict[str, Any] = _SIZES, **fields: Any) -> dict[str, Any]:
    return {"architectures": [_CLASSES[model_type]], "model_type": model_type, **sizes, **fields}


def hf_config(cfg: dict[str, Any]):
    return transformers.AutoConfig.for_model(**cfg)


def hf_modules(cfg: dict[str, Any]):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(hf_config(cfg))


# ---- rotary: transformers 4 and 5 layouts ----

_ROPE_CASES = {
    "v5 llama3": dict(rope_parameters=_LLAMA3 | {"rope_theta": 500000.0}),
    "v4 llama3": dict(rope_theta=500000.0, rope_scaling=dict(_LLAMA3)),
    "v4 linear, old 'type' key": dict(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 4.0}),
    "v5 linear": dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}),
    "v5 default": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "v4 default": dict(rope_theta=1e6, rope_scaling=None),
    "nothing said": dict(),
    "both layouts, agreeing": dict(rope_theta=500000.0, rope_scaling=dict(_LLAMA3),
                                   rope_parameters=_LLAMA3 | {"rope_theta": 500000.0}),
    "v5 llama3 without its original length": dict(
        rope_parameters={k: v for k, v in _LLAMA3.items() if k != "original_max_position_embeddings"}),
}


@pytest.mark.parametrize("fields", _ROPE_CASES.values(), ids=_ROPE_CASES.keys())
def test_rotary_frequencies_equal_transformers(fields):
    cfg = config(**fields)
    ours = ArchConfig.from_hf_config(cfg)
    rotary = LlamaRotaryEmbedding(hf_config(cfg))
    assert rotary.attention_scaling == 1.0  # no rope type we accept rescales cos/sin
    expected = rotary.inv_freq
    # the same formula in float32, evaluated in another order: a few ulps (float32's is 1.2e-7)
    torch.testing.assert_close(inverse_frequencies(ours.head_dim, ours.rope_theta, ours.rope_scaling), expected,
                               atol=0, rtol=1e-6)


def test_scaled_and_unscaled_frequencies_differ():
    # Guards the case above: were llama3 a no-op here, dropping it would go unnoticed.
    scaled = ArchConfig.from_hf_config(config(**_ROPE_CASES["v5 llama3"]))
    plain = ArchConfig.from_hf_config(config(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    assert scaled.rope_scaling.kind == "llama3" and plain.rope_scaling.kind == "default"
    a = inverse_frequencies(16, scaled.rope_theta, scaled.rope_scaling)
    b = inverse_frequencies(16, plain.rope_theta, plain.rope_scaling)
    assert not torch.allclose(a, b)


_ROPE_REFUSALS = {
    "dynamic": (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
                "unsupported rope type 'dynamic'"),
    "yarn, v4 layout": (dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
                        "unsupported rope type 'yarn'"),
    "longrope": (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                       "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}),
                 "unsupported rope type 'longrope'"),
    "per layer type": (dict(layer_types=["full_attention", "sliding_attention"], rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "per layer type"),
    "layouts disagree on scaling": (dict(rope_scaling=dict(_LLAMA3),
                                         rope_parameters={"rope_type": "default", "rope_theta": 1e4}), "disagree"),
    # transformers 5 takes rope_scaling whole and the theta from the top level (10000 here): the
    # rope_parameters' 500000 is lost without a word.
    "layouts disagree on theta": (dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                       rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}),
                                  "disagree"),
    "two thetas": (dict(rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
                   "rope_theta 10000.0 at the top level"),
    "partial rotary": (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                             "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    "llama3 length at the top level": (
        dict(original_max_position_embeddings=64,
             rope_parameters={k: v for k, v in _LLAMA3.items() if k != "original_max_position_embeddings"}),
        "top level"),
    "llama3 without factor": (dict(rope_parameters={k: v for k, v in _LLAMA3.items() if k != "factor"}),
                              "needs 'factor'"),
}


@pytest.mark.parametrize("fields, message", _ROPE_REFUSALS.values(), ids=_ROPE_REFUSALS.keys())
def test_unsupported_or_contradictory_rope_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ArchConfig.from_hf_config(config("qwen2", **fields))


# ---- sliding window: the window some layer applies, as transformers decides it ----


def transformers_window(cfg: dict[str, Any]) -> int | None:
    hf = hf_config(cfg)
    if hf.model_type == "llama":  # LlamaAttention has no window
        return None
    if hf.model_type == "mistral":  # MistralAttention slides on every layer whenever a window is set
        return hf.sliding_window
    windows = {layer.self_attn.sliding_window for layer in hf_modules(cfg).model.layers}
    assert len(windows - {None}) <= 1
    return max(windows - {None}, default=None)


_WINDOWS = {
    "qwen2 flag off, window kept (Qwen2.5 style)": config("qwen2", use_sliding_window=False, sliding_window=32768,
                                                          max_window_layers=28),
    "qwen2 flag on, upper layers slide": config("qwen2", use_sliding_window=True, sliding_window=16,
                                                max_window_layers=1),
    "qwen2 flag on, no layer past max_window_layers": config("qwen2", use_sliding_window=True, sliding_window=16,
                                                             max_window_layers=2),
    "qwen3 layer_types": config("qwen3", use_sliding_window=True, sliding_window=16,
                                layer_types=["sliding_attention", "full_attention"]),
    "qwen3 layer_types all full": config("qwen3", use_sliding_window=True, sliding_window=16,
                                         layer_types=["full_attention", "full_attention"]),
    "qwen2 as transformers 5 saves it": config("qwen2", use_sliding_window=False, sliding_window=None,
                                               max_window_layers=28, layer_types=["full_attention"] * 2),
    "mistral window": config("mistral", sliding_window=16),
    "mistral null window": config("mistral", sliding_window=None),
    "mistral window left out": config("mistral"),
    "llama names a window it never applies": config("llama", sliding_window=16),
}


@pytest.mark.parametrize("cfg", _WINDOWS.values(), ids=_WINDOWS.keys())
def test_sliding_window_equals_transformers(cfg):
    assert ArchConfig.from_hf_config(cfg).sliding_window == transformers_window(cfg)


@pytest.mark.parametrize("fields, message", [
    (dict(use_sliding_window=False, sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
     "no window is in force"),
    (dict(use_sliding_window=True, sliding_window=16, layer_types=["full_attention", "chunked_attention"]),
     "chunked_attention"),
    (dict(layer_types=["full_attention"] * 3), "one entry per layer"),
])
def test_unsupported_or_contradictory_layer_types_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ArchConfig.from_hf_config(config("qwen3", **fields))


# ---- fields left out, and flags that change the weights ----


@pytest.mark.parametrize("model_type", list(_CLASSES))
def test_fields_left_out_take_transformers_defaults(model_type):
    # Only what no class defaults; 32 heads so that Mistral's 8 and Qwen's 32 KV heads divide them.
    sizes = dict(hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=32, vocab_size=128)
    cfg = config(model_type, sizes)
    ours = ArchConfig.from_hf_config(cfg)
    hf = hf_config(cfg)
    attn = hf_modules(cfg).model.layers[0].self_attn
    assert ours.num_kv_heads == hf.num_key_value_heads
    assert ours.head_dim == attn.head_dim  # Qwen3: 128, not hidden / heads
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.rope_theta == hf.rope_parameters["rope_theta"] and ours.rope_scaling.kind == "default"
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.sliding_window == transformers_window(cfg)  # Mistral: 4096


@pytest.mark.parametrize("model_type, attention_bias", [("qwen2", False), ("mistral", True)])
def test_attention_bias_is_read_only_where_transformers_reads_it(model_type, attention_bias):
    # Qwen2 always biases q/k/v and Mistral never does, whatever attention_bias says.
    cfg = config(model_type, attention_bias=attention_bias)
    attn = hf_modules(cfg).model.layers[0].self_attn
    assert ArchConfig.from_hf_config(cfg).qkv_bias == (attn.q_proj.bias is not None)
    assert attn.o_proj.bias is None


@pytest.mark.parametrize("model_type, fields, message", [
    ("llama", dict(attention_bias=True), "attention_bias=true is not supported for LlamaForCausalLM"),
    ("qwen3", dict(attention_bias=True), "attention_bias=true is not supported for Qwen3ForCausalLM"),
    ("llama", dict(mlp_bias=True), "mlp_bias=true"),
    ("mistral", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_flags_that_need_weights_we_lack_are_refused(model_type, fields, message):
    cfg = config(model_type, **fields)
    with pytest.raises(ValueError, match=message):
        ArchConfig.from_hf_config(cfg)


def test_llama_attention_bias_biases_o_proj_in_transformers():
    # Why the flag is refused rather than read as "q/k/v biases": transformers biases o_proj too.
    attn = hf_modules(config("llama", attention_bias=True)).model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is not None
