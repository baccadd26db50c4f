"""A model's description without its weights: config, tokenizer (with its chat template) and
generation config. The router needs this much and no more, so it reads no tensor and imports no
torch; workers read the whole checkpoint (`loader.load_checkpoint`).
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


def load_model_info(model: str | Path) -> ModelInfo:
    """Of a Hugging Face directory or a .gguf file (its converted copy in the cache when there is
    one: the same files a worker reads, tokenizer included)."""
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(model)!r} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        from pdserve.models.default_model import cache_entry

        entry = cache_entry(path)
        if (entry / "config.json").is_file() and (entry / "tokenizer.json").is_file():
            try:
                return read_hf_info(entry)
            except (OSError, ValueError):  # damaged: the GGUF itself says the same, more slowly
                pass
        from gguf import GGUFReader

        from pdserve.models.gguf_info import read_gguf_info

        return read_gguf_info(GGUFReader(path), path)
    if path.is_dir():
        return read_hf_info(path)
    raise ValueError(f"{str(model)!r} is neither a model directory nor a .gguf file")


def read_hf_info(path: Path) -> ModelInfo:
    config_file = path / "config.json"
    if not config_file.exists():
        raise ValueError(f"{path} is not a model directory: config.json not found")
    gen_file = path / "generation_config.json"
    generation_config = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    return ModelInfo(json.loads(config_file.read_text()), Tokenizer.from_dir(path), generation_config)
