"""A model's description without its weights: config, tokenizer (with its chat template) and
generation config, as a Hugging Face directory holds them. `describe.load_model_info` reads it of
any model the project loads; workers read the whole checkpoint (`loader.load_checkpoint`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.tokenizer import Tokenizer


@dataclass(slots=True)
class ModelInfo:
    hf_config: dict[str, Any]
    tokenizer: Tokenizer
    generation_config: dict[str, Any] = field(default_factory=dict)


def read_hf_info(path: Path) -> ModelInfo:
    config_file = path / "config.json"
    if not config_file.exists():
        raise ValueError(f"{path} is not a model directory: config.json not found")
    gen_file = path / "generation_config.json"
    generation_config = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    return ModelInfo(json.loads(config_file.read_text()), Tokenizer.from_dir(path), generation_config)
