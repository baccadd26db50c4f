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
