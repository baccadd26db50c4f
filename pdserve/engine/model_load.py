"""The model an engine serves: its checkpoint, the choices made for it on this device (activation
dtype, quantization, compiled decode, a draft head), and the model built from them. An engine
builds it in its constructor (`load`); a standby worker builds it before it is needed (`preload`),
and the engine later made with the same config takes that one instead of building it again."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable

import torch

from pdserve.config import EngineConfig
from pdserve.engine.dtype_choice import choose_dtype
from pdserve.engine.parallel.ranks import Ranks, threads_per_rank
from pdserve.engine.spec.proposers import HEAD_PREFIX
from pdserve.models.arch_config import ArchConfig
from pdserve.models.checkpoint import Checkpoint
from pdserve.models.loader import build_model, load_checkpoint
from pdserve.models.shard import Shard, check_divisible

log = logging.getLogger("pdserve.engine")


@dataclass
class LoadedModel:
    checkpoint: Checkpoint
    arch: ArchConfig
    dtype: torch.dtype
    compile_decode: bool
    head_path: str  # a draft head's weights ("": none)
    model: torch.nn.Module
    ranks: Ranks | None = None  # tensor parallel: the worker's other ranks, running their shards

    def max_model_len(self, config: EngineConfig) -> int:
        limit = self.arch.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit of {limit}")
        return config.max_model_len or limit

    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.arch.eos_token_ids)
        eos = self.checkpoint.generation_config.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.checkpoint.tokenizer.eos_token_id is not None:
            ids.add(self.checkpoint.tokenizer.eos_token_id)
        return tuple(sorted(ids))


_preloaded: dict[str, LoadedModel] = {}  # by the repr of the config it was built for; taken once


def preload(config: EngineConfig, device: torch.device, make_engine: Callable[[EngineConfig], object]) -> LoadedModel:
    """Build now what `load` with this config will return."""
    loaded = _preloaded[repr(config)] = _build(config, device, make_engine)
    return loaded


def load(config: EngineConfig, device: torch.device, make_engine: Callable[[EngineConfig], object]) -> LoadedModel:
    """The model for an engine of `config`: the one preloaded for it, else built now. `make_engine`
    builds the engines `--dtype auto` times where it has no measurement yet."""
    return _preloaded.pop(repr(config), None) or _build(config, device, make_engine)


def _build(config: EngineConfig, device: torch.device, make_engine: Callable[[EngineConfig], object]) -> LoadedModel:
    ckpt = load_checkpoint(config.model)
    arch = ArchConfig.from_hf_config(ckpt.hf_config)
    dtype = choose_dtype(config, device, arch, make_engine)
    compile_decode = config.compile_decode and config.role != "prefill"  # a prefill worker never decodes
    quantization = config.quantization if device.type == "cpu" else "none"  # auto: CPU kernels only
    if compile_decode and (quantization in ("int4", "int8") or (quantization == "auto" and ckpt.quantized_bits)):
        log.warning("compiled decode needs dense weights (--quantization none): quantized weights run "
                    "pdserve's kernels, which a compiled graph cannot hold; decode runs eager")
        compile_decode = False
    head_path = config.speculative.removeprefix(HEAD_PREFIX).strip() if config.speculative.startswith(HEAD_PREFIX) else ""
    if head_path and compile_decode:
        log.warning("a draft head reads the model's hidden states, which a compiled decode graph does not "
                    "give: decode runs eager")
        compile_decode = False
    size = config.tensor_parallel_size
    if size == 1:
        model = build_model(ckpt, dtype, device, quantization, pack_weights=not compile_decode)
        return LoadedModel(ckpt, arch, dtype, compile_decode, head_path, model)
    # the other ranks load while this one does; each takes its share of the CPU threads
    check_divisible(arch, Shard(0, size, config.expert_parallel))
    ranks = Ranks(replace(config, dtype=str(dtype).removeprefix("torch."), quantization=quantization), size)
    torch.set_num_threads(threads_per_rank(config, size))
    try:
        model = build_model(ckpt, dtype, device, quantization, shard=Shard(0, size, config.expert_parallel))
        model.join(ranks.join(device, arch.hidden_size))
    except BaseException:
        ranks.stop()
        raise
    log.info("tensor parallel: %d ranks of %d threads each", size, torch.get_num_threads())
    return LoadedModel(ckpt, arch, dtype, compile_decode, head_path, model, ranks)
