"""Token sampling for a batch of requests with different settings.

Greedy rows take the argmax. Other rows: temperature, then top-k, top-p and min-p cuts, then a
draw by the exponential race (argmax of p / E with E ~ Exp(1)), which samples from p exactly and
lets a seeded request draw its noise from its own generator, independent of its batch mates.
"""

from __future__ import annotations

import torch

from pdserve.engine.request import Request


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        # logits: [rows, vocab] float32, one row per request
        greedy = logits.argmax(dim=-1)
        if all(r.params.greedy for r in requests):
            return greedy.tolist()
        device = logits.device
        temps = torch.tensor([r.params.temperature if not r.params.greedy else 1.0 for r in requests], device=device)
        logits = logits / temps.unsqueeze(1)
        top_ks = [r.params.top_k for r in requests]
        if any(top_ks):
            logits = _apply_top_k(logits, top_ks)
        probs = logits.softmax(dim=-1)
        min_ps = [r.params.min_p for r in requests]
        if any(min_ps):
            probs = _apply_min_p(probs, torch.tensor(min_ps, device=device))
        top_ps = [r.params.top_p for r in requests]
        if any(p < 1.0 for p in top_ps):
            probs = _apply_top_p(probs, torch.tensor(top_ps, device=device))
        # Drawn on the CPU, where the per-request generators live, so results match across devices.
        noise = _exponential_noise(probs.shape, requests, self.generator).to(device)
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([r.params.greedy for r in requests], device=device)
        return torch.where(is_greedy, greedy, sampled).tolist()


def _exponential_noise(shape: torch.Size, requests: list[Request], default: torch.Generator) -> torch.Tensor:
    noise = torch.empty(shape)
    for i, req in enumerate(requests):
        noise[i].exponential_(generator=req.generator or default)
    return noise


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
    kth = logits.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    threshold = probs.max(dim=-1, keepdim=True).values * min_ps.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def _apply_top_p(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    # Keep the smallest set of most likely tokens whose mass reaches top_p (the first always stays).
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= top_ps.unsqueeze(1) * sorted_probs.sum(dim=-1, keepdim=True)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)
