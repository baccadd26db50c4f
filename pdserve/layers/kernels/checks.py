"""The argument checks every wrapper of pdserve's C kernels shares."""

from __future__ import annotations

import torch


def contiguous(*tensors: torch.Tensor) -> None:
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("pdserve's kernels take contiguous tensors")


def check(rc: int, name: str) -> None:
    if rc:
        raise RuntimeError(f"pdserve's {name} kernel refused its arguments")
