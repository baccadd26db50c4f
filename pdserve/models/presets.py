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
}
