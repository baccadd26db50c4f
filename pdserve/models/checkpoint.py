"""A model checkpoint in memory: Hugging Face config, tensors under Hugging Face names, tokenizer.

Every format pdserve reads (a Hugging Face directory, a GGUF file) is turned into a `Checkpoint`;
the model is built from that alone, and `save` writes it back as a Hugging Face directory (a
GGUF's blocks expanded to float32 there; its Q4_1 and Q8_0 ones, in `quantized_bits`, served in
those bits again).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdserve.layers.block_formats import StoredBlocks
from pdserve.models.model_info import read_hf_info
from pdserve.tokenizer import Tokenizer

# Beside the weights: which tensors came quantized (GGUF), so they can be served that way again.
QUANTIZED_BITS_FILE = "pdserve_quantized_bits.json"


@dataclass(slots=True)
class Checkpoint:
    hf_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]  # Hugging Face parameter names
    tokenizer: Tokenizer
    generation_config: dict[str, Any] = field(default_factory=dict)
    # tensor name -> 4 or 8: stored quantized by a rule `layers/quant.py` reproduces exactly from
    # the dequantized values (GGUF's Q4_1 and Q8_0), so quantizing it again loses nothing
    quantized_bits: dict[str, int] = field(default_factory=dict)
    # tensor name -> its file's blocks (a GGUF's matmul weights, served as stored); not in `tensors`
    blocks: dict[str, StoredBlocks] = field(default_factory=dict)

    def names(self) -> set[str]:
        return set(self.tensors) | set(self.blocks)

    def float_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor's values, blocks expanded to float32 by the reference rules (slow for a
        large model: for export and tests)."""
        return self.tensors | {name: b.dequantize() for name, b in self.blocks.items()}

    def save(self, out_dir: str | Path, max_shard_bytes: int = 2 << 30) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(self.hf_config, indent=2))
        (out / "generation_config.json").write_text(json.dumps(self.generation_config, indent=2))
        self.tokenizer.save(out)
        _save_sharded(self.float_tensors(), out, max_shard_bytes)
        if self.quantized_bits:
            (out / QUANTIZED_BITS_FILE).write_text(json.dumps(self.quantized_bits, indent=1))


def load_hf_dir(path: str | Path) -> Checkpoint:
    path = Path(path)
    info = read_hf_info(path)
    return Checkpoint(info.hf_config, read_safetensors(path), info.tokenizer, info.generation_config,
                      _read_quantized_bits(path))


def _read_quantized_bits(path: Path) -> dict[str, int]:
    file = path / QUANTIZED_BITS_FILE
    if not file.exists():
        return {}
    bits = json.loads(file.read_text())
    if not isinstance(bits, dict) or not all(isinstance(k, str) and v in (4, 8) for k, v in bits.items()):
        raise ValueError(f"{file} must map tensor names to 4 or 8")
    return bits


def read_safetensors(path: Path, files: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors weights (its index's shards, else every
    *.safetensors file; or the named `files`)."""
    index = path / "model.safetensors.index.json"
    if files is None and index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif files is None:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} holds no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        file = path / name
        if not file.exists():
            raise ValueError(f"weight shard {name} listed in the index is missing from {path}")
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def _save_sharded(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
