"""Which layers of a model attend to a sliding window of their last tokens, read from a Hugging
Face config.json as transformers' class for the architecture reads it.

Each family decides differently (`_Family.sliding` in `arch_config`):
- "never": Llama ignores any window a config names;
- "always": Mistral and Mixtral slide on every layer whenever a window is set;
- "opt_in": Qwen2/Qwen3 slide only with `use_sliding_window`, on the layers `layer_types` marks
  (transformers 5 writes it) or, in older configs, on every layer from `max_window_layers` on;
- "opt_in_all": Qwen3-MoE slides on every layer with `use_sliding_window`;
- "pattern": Gemma 3 slides on the layers `layer_types` marks, else on all but every
  `sliding_window_pattern`th (default 6: five local layers, then a global one).
A window of w lets the token at position p see keys p - w + 1 .. p (transformers' overlay:
`kv_idx > q_idx - sliding_window`).
"""

from __future__ import annotations

from typing import Any

_LAYER_TYPES = {"full_attention", "sliding_attention"}


def read_sliding(cfg: dict[str, Any], kind: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(the window, the layers that slide); (None, ()) when no layer does."""
    if kind == "never":
        return None, ()
    window = int(cfg["sliding_window"]) if cfg.get("sliding_window") else None
    everywhere = tuple(range(num_layers))
    if kind == "always":
        return (window, everywhere) if window else (None, ())
    if kind == "opt_in_all":
        return (window, everywhere) if window and cfg.get("use_sliding_window") else (None, ())
    if kind == "pattern":
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            every = int(cfg.get("sliding_window_pattern") or 6)
            layer_types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
        return _by_layer_types(layer_types, window, num_layers, "sliding_window")
    # "opt_in": Qwen2/Qwen3, only with use_sliding_window
    if not cfg.get("use_sliding_window"):
        window = None
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        first = int(cfg["max_window_layers"])
        return (window, tuple(range(first, num_layers))) if window and num_layers > first else (None, ())
    return _by_layer_types(layer_types, window, num_layers,
                           f"use_sliding_window={cfg.get('use_sliding_window')}, "
                           f"sliding_window={cfg.get('sliding_window')}")


def _by_layer_types(layer_types: list[str], window: int | None, num_layers: int,
                    window_fields: str) -> tuple[int | None, tuple[int, ...]]:
    if len(layer_types) != num_layers or not set(layer_types) <= _LAYER_TYPES:
        raise ValueError(
            f"layer_types {layer_types} is not supported: pdserve needs one entry per layer "
            f"({num_layers}), each full_attention or sliding_attention"
        )
    sliding = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    if not sliding:
        return None, ()
    if window is None:
        raise ValueError(f"layer_types marks sliding_attention layers but no window is in force ({window_fields})")
    return window, sliding
