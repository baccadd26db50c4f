"""What the router knows of a model: its description (`ModelInfo`) without its weights, of a Hugging
Face directory or a .gguf file. It reads no tensor and imports no torch."""

from __future__ import annotations

from pathlib import Path

from pdserve.models.model_info import ModelInfo, read_hf_info


def load_model_info(model: str | Path) -> ModelInfo:
    """Of a Hugging Face directory or a .gguf file (read as a worker reads it: tokenizer included)."""
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(model)!r} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        from pdserve.models.gguf_file import GgufFile
        from pdserve.models.gguf_info import read_gguf_info

        with GgufFile(path) as gguf:
            return read_gguf_info(gguf)
    if path.is_dir():
        return read_hf_info(path)
    raise ValueError(f"{str(model)!r} is neither a model directory nor a .gguf file")
