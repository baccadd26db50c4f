"""Quantized KV on the wire: size, round trip error, and the scales carried with the data."""

import pytest
import torch

from pdserve.kv_transfer.base import KVLayout
from pdserve.kv_transfer.quant import dequantize_into, encoded_size, gather_slots, quantize

LAYOUT = KVLayout("m", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")


@pytest.mark.parametrize("encoding, tolerance", [("int8", 1 / 127), ("fp8", 1 / 8)])
def test_round_trip_error_is_bounded_per_head(encoding, tolerance):
    g = torch.Generator().manual_seed(0)
    src = torch.randn(2, 40, 2, 2, 16, generator=g) * torch.logspace(-2, 2, 40).view(1, 40, 1, 1, 1)
    runs_src, runs_dst = [(3, 10), (20, 7)], [(0, 5), (25, 12)]
    payload = quantize(gather_slots(src, 1, runs_src), encoding)
    assert len(payload) == encoded_size(LAYOUT, 17, encoding) < encoded_size(LAYOUT, 17, "raw")
    dst = torch.zeros_like(src)
    dequantize_into(dst, 1, runs_dst, torch.frombuffer(bytearray(payload), dtype=torch.uint8), LAYOUT, encoding)
    got = torch.cat([dst[1, 0:5], dst[1, 25:37]])
    want = gather_slots(src, 1, runs_src)
    scale = want.abs().amax(dim=-1, keepdim=True)  # error relative to each head's largest value
    assert ((got - want).abs() <= tolerance * scale + 1e-12).all()
    assert dst[0].abs().sum() == 0 and dst[1, 5:25].abs().sum() == 0 and dst[1, 37:].abs().sum() == 0  # nothing outside the runs


def test_unknown_encoding_is_refused():
    with pytest.raises(ValueError, match="unknown KV encoding"):
        encoded_size(LAYOUT, 4, "int3")
