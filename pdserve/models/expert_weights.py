"""A layer's MLP weights from a checkpoint, dense or routed experts, under every naming in use.

Experts come as one tensor per expert (`mlp.experts.{j}.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.{j}.w1/w3/w2.weight`: the released checkpoints) or stacked, as
transformers 5 saves them (`mlp.experts.gate_up_proj` [experts, 2 * intermediate, hidden],
`mlp.experts.down_proj` [experts, hidden, intermediate]). Either way each expert becomes one gated
MLP with its gate and up projections fused.
"""

from __future__ import annotations

from typing import Iterator, Protocol

import torch

from pdserve.models.arch_config import ArchConfig


class TensorSource(Protocol):
    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor: ...
    def has(self, name: str) -> bool: ...


def fuse(parts: list[torch.Tensor]) -> torch.Tensor:
    """Weights stacked along their outputs (q/k/v, gate/up); a placeholder on the meta device where
    any part is one (blocks the loader serves as stored, or expands whole where mixed)."""
    if any(p.is_meta for p in parts):
        return torch.empty(sum(p.shape[0] for p in parts), *parts[0].shape[1:], dtype=parts[0].dtype, device="meta")
    return torch.cat(parts)


def take_mlp(tensors: TensorSource, h: int, inter: int, src: str, dst: str, params: dict[str, torch.Tensor],
             sources: dict[str, list[str]], names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
             ) -> None:
    """A gated MLP stored as separate gate, up and down weights under `src` (`names`)."""
    gate, up, down = (f"{src}{n}.weight" for n in names)
    params[dst + "gate_up_proj"] = fuse([tensors.take(gate, (inter, h)), tensors.take(up, (inter, h))])
    params[dst + "down_proj"] = tensors.take(down, (h, inter))
    sources[dst + "gate_up_proj"], sources[dst + "down_proj"] = [gate, up], [down]


def take_experts(tensors: TensorSource, cfg: ArchConfig, src: str, dst: str, params: dict[str, torch.Tensor],
                 sources: dict[str, list[str]]) -> None:
    """Layer `src`'s router, experts and shared expert, as `models.mlp.SparseMoE` holds them."""
    e, h = cfg.experts, cfg.hidden_size
    mixtral = tensors.has(src + "block_sparse_moe.gate.weight")
    moe = src + ("block_sparse_moe." if mixtral else "mlp.")
    params[dst + "gate"] = tensors.take(moe + "gate.weight", (e.count, h))
    inter = e.intermediate_size
    if tensors.has(moe + "experts.gate_up_proj"):
        gate_up = tensors.take(moe + "experts.gate_up_proj", (e.count, 2 * inter, h))
        down = tensors.take(moe + "experts.down_proj", (e.count, h, inter))
        for j in range(e.count):
            params[f"{dst}experts.{j}.gate_up_proj"], params[f"{dst}experts.{j}.down_proj"] = gate_up[j], down[j]
            sources[f"{dst}experts.{j}.gate_up_proj"] = [moe + "experts.gate_up_proj"]
            sources[f"{dst}experts.{j}.down_proj"] = [moe + "experts.down_proj"]
    else:
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for j in range(e.count):
            take_mlp(tensors, h, inter, f"{moe}experts.{j}.", f"{dst}experts.{j}.", params, sources, names)
    if e.shared_intermediate_size:
        take_mlp(tensors, h, e.shared_intermediate_size, moe + "shared_expert.", dst + "shared_expert.", params,
                 sources)
        params[dst + "shared_expert_gate"] = tensors.take(moe + "shared_expert_gate.weight", (1, h))


def gated_mlps(mlp: torch.nn.Module, name: str) -> Iterator[tuple[str, torch.nn.Module]]:
    """The gated MLPs of a layer's feed-forward part, by parameter-name prefix: itself, or its
    experts and shared expert."""
    experts = getattr(mlp, "experts", None)
    if experts is None:
        yield name, mlp
        return
    for j, expert in enumerate(experts):
        if mlp.held is None or j in mlp.held:
            yield f"{name}.experts.{j}", expert
    if mlp.shared_expert is not None:
        yield f"{name}.shared_expert", mlp.shared_expert
