"""bfloat16 weights in oneDNN's blocked layout: the layout is chosen by timing on this CPU, and
whichever it is, the products are F.linear's."""

import pytest
import torch
import torch.nn.functional as F

from pdserve.layers import packed
from pdserve.layers.cpu import onednn_packs_bfloat16

pytestmark = pytest.mark.skipif(not onednn_packs_bfloat16(),
                                reason="oneDNN keeps no bfloat16 weights blocked on this CPU (AVX2 only)")


def test_each_weight_shape_gets_a_layout_measured_once():
    packed._fastest_hint.cache_clear()
    hint = packed._fastest_hint(96, 64)
    assert hint in packed._HINTS
    assert packed._fastest_hint(96, 64) == hint and packed._fastest_hint.cache_info().hits == 1


@pytest.mark.parametrize("hint", packed._HINTS)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_every_layout_gives_f_linears_products(hint, rows):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
    got = packed.packed_linear(x, torch.ops.mkldnn._reorder_linear_weight(weight, hint))
    # float32 sums in another order, then one rounding to bfloat16: at most one unit apart
    torch.testing.assert_close(got, F.linear(x, weight), atol=1e-2, rtol=2**-7)


def test_pack_weight_leaves_float32_weights_plain():
    weight = torch.randn(8, 16)
    assert packed.pack_weight(weight) is weight


def test_rows_are_padded_to_few_counts_at_most_an_eighth_more():
    assert [packed.padded_rows(r) for r in (1, 15, 16, 17, 1000, 1024, 1025)] == [1, 15, 16, 18, 1024, 1024, 1152]
    counts = packed.row_counts(2048)
    assert counts[-1] == 2048 and len(counts) == len(set(counts)) < 80
    for rows in range(1, 2049):
        padded = packed.padded_rows(rows)
        assert padded in counts and rows <= padded <= rows * 9 / 8


def test_a_padded_product_keeps_only_its_own_rows():
    weight = torch.randn(96, 64).to(torch.bfloat16)
    x = torch.randn(17, 64).to(torch.bfloat16)  # runs as 18 rows
    got = packed.packed_linear(x, torch.ops.mkldnn._reorder_linear_weight(weight, None))
    assert got.shape == (17, 96) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight), atol=1e-2, rtol=2**-7)


def test_an_activation_buffer_is_read_padded_in_place(monkeypatch):
    weight = torch.randn(96, 64).to(torch.bfloat16)
    x = packed.activation_buffer(1000, 64, torch.bfloat16)  # runs as 1024 rows
    assert x.shape == (1000, 64) and x.untyped_storage().nbytes() == 1024 * 64 * 2
    x.copy_(torch.randn(1000, 64))
    # the padding rows hold whatever the memory held, NaN included: it must not reach the rows kept
    torch.as_strided(x, (1024, 64), (64, 1))[1000:] = float("nan")
    monkeypatch.setattr(packed.F, "pad", lambda *a: pytest.fail("padded by a copy"))
    got = packed.packed_linear(x, torch.ops.mkldnn._reorder_linear_weight(weight, None))
    assert got.shape == (1000, 96) and not got.isnan().any()
    torch.testing.assert_close(got, F.linear(x, weight), atol=1e-2, rtol=2**-7)
