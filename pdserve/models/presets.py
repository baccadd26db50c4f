"""The synthetic models' sizes and architectures, by name: plain data, so that resolving a model
name needs neither torch nor the generator (`synthetic`)."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024),
    "demo": dict(hidden_size=768, intermediate_size=2560, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=8192, max_position_embeddings=4096),
}

# Flags of each supported architecture, in Hugging Face config names.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False,
                  tie_word_embeddings=False),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None,
                    tie_word_embeddings=False),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True,
                  use_sliding_window=False),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=True,
                  attention_bias=False, use_sliding_window=False),
    # Gemma 3 (text): GELU-gated, (1 + w) norms around attention and MLP, local and global layers
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", tie_word_embeddings=True,
                   hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
                   rope_local_base_freq=10000.0),
    # mixtures of experts, scaled to the preset: its intermediate size split among the top-k
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", sliding_window=None,
                    tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", tie_word_embeddings=False,
                      use_sliding_window=False, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=[0]),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", tie_word_embeddings=False,
                      attention_bias=False, use_sliding_window=False, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
}

# The sizes of a mixture-of-experts preset's experts, as fractions of its `intermediate_size`.
EXPERT_SIZES: dict[str, dict[str, float]] = {
    "qwen2_moe": dict(moe_intermediate_size=0.5, shared_expert_intermediate_size=1.0),
    "qwen3_moe": dict(moe_intermediate_size=0.5),
}
