"""Which part of each weight a tensor-parallel rank holds, and the model config it builds from.

Megatron's split, on the weights as the loader fuses them: q/k/v projections by heads (each rank
its query heads and the KV heads they read, so its KV cache holds only those), the output
projection by the same input columns; the MLP's gate/up by output rows and down by input columns;
so each rank's attention and MLP outputs are partial sums that one all-reduce adds. The head is
split by vocabulary rows (each rank's logits for its share of the tokens, gathered); the embedding
table stays whole on every rank (a lookup, no product). Routed experts are split like the MLP
(each rank a slice of every expert), or with expert parallelism whole, each rank holding a
contiguous share of the experts. Routers and norms are whole everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pdserve.models.arch_config import ArchConfig


@dataclass(slots=True, frozen=True)
class Shard:
    rank: int
    size: int
    expert_parallel: bool = False

    def part(self, n: int) -> slice:
        """This rank's slice of `n` things split evenly."""
        step = n // self.size
        return slice(self.rank * step, (self.rank + 1) * step)

    def vocab_rows(self, vocab: int) -> slice:
        """This rank's rows of the head: ceil(vocab / size) each, the last rank's fewer."""
        step = -(-vocab // self.size)
        return slice(min(self.rank * step, vocab), min((self.rank + 1) * step, vocab))

    def held_experts(self, count: int) -> range:
        return range(count) if not self.expert_parallel else range(count)[self.part(count)]


def check_divisible(cfg: ArchConfig, shard: Shard) -> None:
    """Refuse a split the model's sizes do not allow, naming the size that does not divide."""
    n = shard.size
    sizes = {"num_key_value_heads": cfg.num_kv_heads, "num_attention_heads": cfg.num_heads,
             "intermediate_size": cfg.intermediate_size}
    e = cfg.experts
    if e is not None:
        sizes["num_experts" if shard.expert_parallel else "moe_intermediate_size"] = (
            e.count if shard.expert_parallel else e.intermediate_size)
        if e.shared_intermediate_size:
            sizes["shared_expert_intermediate_size"] = e.shared_intermediate_size
        if all(cfg.sparse(i) for i in range(cfg.num_layers)):
            del sizes["intermediate_size"]  # no dense MLP to split
    for name, value in sizes.items():
        if value % n:
            raise ValueError(f"tensor parallel size {n} does not divide the model's {name} ({value})")


def local_config(cfg: ArchConfig, shard: Shard) -> ArchConfig:
    """The config of one rank's layers: its heads, its MLP columns, its experts' columns. (Its
    vocabulary rows are the head's own; the config keeps the whole vocabulary for the embedding.)"""
    if shard.size == 1:
        return cfg
    n = shard.size
    experts = cfg.experts
    if experts is not None:
        experts = replace(experts,
                          intermediate_size=experts.intermediate_size // (1 if shard.expert_parallel else n),
                          shared_intermediate_size=experts.shared_intermediate_size // n)
    return replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=cfg.num_kv_heads // n,
                   intermediate_size=cfg.intermediate_size // n, experts=experts)


def shard_params(params: dict[str, torch.Tensor], cfg: ArchConfig, shard: Shard) -> dict[str, torch.Tensor]:
    """The loader's whole-model parameters (fused names) cut to this rank's; experts it does not
    hold (expert parallelism) are left out."""
    if shard.size == 1:
        return params
    q, kv = cfg.q_size, cfg.kv_size
    heads, kv_heads = shard.part(cfg.num_heads), shard.part(cfg.num_kv_heads)
    d = cfg.head_dim
    q_rows = slice(heads.start * d, heads.stop * d)
    kv_rows = slice(kv_heads.start * d, kv_heads.stop * d)
    out: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("qkv_proj", "qkv_bias"):
            t = torch.cat([t[:q][q_rows], t[q : q + kv][kv_rows], t[q + kv :][kv_rows]])
        elif leaf == "o_proj":
            t = t[:, q_rows]
        elif leaf in ("gate_up_proj", "down_proj"):
            expert = _expert_index(name)
            if expert is not None and shard.expert_parallel:
                if expert not in shard.held_experts(cfg.experts.count):
                    continue
            elif leaf == "gate_up_proj":
                half = t.shape[0] // 2
                cols = shard.part(half)
                t = torch.cat([t[:half][cols], t[half:][cols]])
            else:
                t = t[:, shard.part(t.shape[1])]
        elif name == "lm_head":
            t = t[shard.vocab_rows(cfg.vocab_size)]
        out[name] = t.contiguous()
    return out


def _expert_index(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[parts.index("experts") + 1]) if "experts" in parts else None
