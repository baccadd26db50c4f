"""What the router knows of a model: its description (`ModelInfo`) without its weights, of a Hugging
Face directory or a .gguf file. It reads no tensor and imports no torch."""

from __future__ import annotations

from pathlib import Path

from pdserve.models.model_info import ModelInfo, read_hf_info


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
