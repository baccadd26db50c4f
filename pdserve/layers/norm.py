"""RMSNorm, computed in float32 as the reference implementation does: by pdserve's kernel when
the step has them (one call instead of a handful of operators), else by torch. `add_and_norm` takes
the residual add before it too, which the kernel does in the same pass over the rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.kernels.native import NativeKernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, kernels: NativeKernels | None = None) -> torch.Tensor:
        if kernels is not None:  # any shape: normalized over the last dimension
            # (a slice of one head per row, as one KV head's keys, reshapes to a strided view: copied)
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return kernels.rms_norm(rows, self.weight, self.eps).view(x.shape)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # As the reference: normalize in float32, round to the activation dtype, then scale.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                     kernels: NativeKernels | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm); with the kernels x itself becomes x + delta. No delta: (x, norm)."""
        if delta is None:
            return x, self(x, kernels)
        if kernels is None:
            x = x + delta
            return x, self(x)
        y = kernels.rms_norm(x.view(-1, x.shape[-1]), self.weight, self.eps, delta.reshape(-1, x.shape[-1]))
        return x, y.view(x.shape)
