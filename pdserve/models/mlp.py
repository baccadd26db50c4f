"""A decoder layer's feed-forward part: the gated MLP (SiLU, or Gemma's GELU), and routed experts
made of them.

Expert weights stay one gated MLP each (fused gate/up, down), so quantization, packing and the
CPU kernels treat an expert's products like any other layer's. A step's tokens are grouped by the
experts they were routed to, each expert multiplying its group at once (a grouped matmul: one
product per expert hit, never one per token), and the weighted outputs added back in expert
order, as transformers adds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.kernels.native import NativeKernels
from pdserve.layers.linear import linear
from pdserve.models.arch_config import ArchConfig, Experts


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class GatedMLP(nn.Module):
    def __init__(self, cfg: ArchConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.intermediate = intermediate_size or cfg.intermediate_size
        self.activation = cfg.activation
        self.gate_up_proj = weight(2 * self.intermediate, cfg.hidden_size)
        self.down_proj = weight(cfg.hidden_size, self.intermediate)

    def forward(self, x: torch.Tensor, kernels: NativeKernels | None = None) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_proj)
        if kernels is not None and self.activation == "silu":
            return linear(kernels.silu_mul(gate_up), self.down_proj)
        if kernels is not None and self.activation == "gelu_tanh":
            return linear(kernels.gelu_mul(gate_up), self.down_proj)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return linear(_ACTIVATIONS[self.activation](gate) * up, self.down_proj)


class SparseMoE(nn.Module):
    """Routed experts (`Experts`): each token's top-k of the router's softmax, and a shared expert
    where the model has one. `held` are the experts this process computes (all of them, or its
    share under expert parallelism: the others' outputs are added by the ranks holding them)."""

    def __init__(self, cfg: ArchConfig, experts: Experts) -> None:
        super().__init__()
        self.top_k, self.normalize = experts.per_token, experts.normalize
        self.gate = weight(experts.count, cfg.hidden_size)  # the router
        self.experts = nn.ModuleList(GatedMLP(cfg, experts.intermediate_size) for _ in range(experts.count))
        shared = experts.shared_intermediate_size
        self.shared_expert = GatedMLP(cfg, shared) if shared else None
        self.shared_expert_gate = weight(1, cfg.hidden_size) if shared else None
        self.held: frozenset[int] | None = None  # None: every expert

    def forward(self, x: torch.Tensor, kernels: NativeKernels | None = None) -> torch.Tensor:
        weights, chosen = self.route(x)
        out = torch.zeros_like(x)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # the (token, k) picks grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        picked_weights = weights.flatten()[order]
        tokens = order // self.top_k
        start = 0
        for expert, n in enumerate(counts):
            if n and (self.held is None or expert in self.held):
                rows = tokens[start : start + n]
                y = self.experts[expert](x[rows], kernels) * picked_weights[start : start + n, None]
                out.index_add_(0, rows, y.to(x.dtype))
            start += n
        if self.shared_expert is not None:
            out += torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x, kernels)
        return out

    def first_held(self) -> GatedMLP:
        return self.experts[min(self.held) if self.held is not None else 0]

    def hold_only(self, held: range) -> None:
        """Keep only experts `held` (expert parallelism): the others' places stay, empty."""
        self.held = frozenset(held)
        for j in range(len(self.experts)):
            if j not in self.held:
                self.experts[j] = nn.Module()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts ([tokens, k]) and their weights (float32)."""
        probs = F.softmax(F.linear(x, self.gate).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen


def feed_forward(cfg: ArchConfig, layer: int) -> GatedMLP | SparseMoE:
    """The layer's MLP: routed experts where the model has them in that layer, else the dense one."""
    return SparseMoE(cfg, cfg.experts) if cfg.sparse(layer) else GatedMLP(cfg)
