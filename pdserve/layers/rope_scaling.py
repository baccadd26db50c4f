"""The parameters of rotary position embedding's frequency scaling, as the rotary layer takes
them (`rotary.py`); `models/rope_config.py` reads them from a checkpoint's config. No torch here:
the router reads model configs without it."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True, frozen=True)
class RopeScaling:
    kind: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
