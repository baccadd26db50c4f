"""pdserve's per-token kernels (norm, SiLU times up, rotary with the cache write, decode attention)
against torch's operators, on every instruction set this CPU runs, in float32 and bfloat16; prefill
attention by each of its kernels the CPU runs (AMX tiles, AVX512-BF16 dot products)."""

import functools
import os
import threading

import pytest
import torch
import torch.nn.functional as F

from pdserve.layers.kernels import native
from pdserve.layers.rotary import apply_rotary
from tests.factories import kernel_isa_params

H, KV, D = 6, 2, 32  # grouped-query attention: three query heads per KV head


@pytest.fixture(params=kernel_isa_params())
def kernels(request):
    return native.load().with_isa(request.param)


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# float32: summation order only (a few units of 2^-24 of the values' size); bfloat16 rounds where
# transformers rounds, so its results are torch's bit for bit except where a sum is involved
EXACT = {torch.float32: 1e-5, torch.bfloat16: 0.0}


@DTYPES
@pytest.mark.parametrize("width", [96, 100])  # whole vectors (the vector loops); else the plain ones
def test_rms_norm(kernels, dtype, width):
    x = (torch.randn(3, width) * 4).to(dtype)
    w = (torch.rand(width) + 0.5).to(dtype)
    ref = (F.rms_norm(x, (width,), w, 1e-6) if dtype == torch.float32
           else w * F.rms_norm(x.float(), (width,), None, 1e-6).to(dtype))
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), ref, atol=EXACT[dtype], rtol=1e-5)


@DTYPES
@pytest.mark.parametrize("width", [96, 100])
def test_rms_norm_after_the_residual_add_adds_in_place(kernels, dtype, width):
    x = (torch.randn(5, width) * 4).to(dtype)
    delta = (torch.randn(5, width) * 4).to(dtype)
    w = (torch.rand(width) + 0.5).to(dtype)
    total = x + delta  # torch's add, rounded to the dtype
    ref = (F.rms_norm(total, (width,), w, 1e-6) if dtype == torch.float32
           else w * F.rms_norm(total.float(), (width,), None, 1e-6).to(dtype))
    y = kernels.rms_norm(x, w, 1e-6, delta)
    torch.testing.assert_close(x, total, atol=0, rtol=0)
    torch.testing.assert_close(y, ref, atol=EXACT[dtype], rtol=1e-5)
    with pytest.raises(ValueError, match="does not match"):
        kernels.rms_norm(x, w, 1e-6, delta[:4])


@DTYPES
@pytest.mark.parametrize("width", [80, 37])  # whole vectors; then a tail the vector loops leave
def test_silu_times_up(kernels, dtype, width):
    gate_up = (torch.randn(3, 2 * width) * 3).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, -60.0, 60.0, 100.0])  # exp's clamp, and beyond it
    gate, up = gate_up.split(width, dim=-1)
    # its exp is within 1e-7 of torch's: a bfloat16 result may round one unit (2^-8) the other way
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=tol)


@DTYPES
@pytest.mark.parametrize("width", [80, 37])
def test_gelu_times_up(kernels, dtype, width):
    """Gemma's MLP: GELU's tanh form, as torch's `gelu(approximate="tanh")` (in bfloat16 rounded
    before the product, as transformers computes it)."""
    gate_up = (torch.randn(3, 2 * width) * 3).to(dtype)
    gate_up[0, :6] = torch.tensor([-100.0, -60.0, -5.0, 1e-4, 60.0, 100.0])  # tails, and near zero
    gate, up = gate_up.split(width, dim=-1)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(kernels.gelu_mul(gate_up), F.gelu(gate, approximate="tanh") * up, atol=1e-6, rtol=tol)


@DTYPES
def test_rotary_in_place_then_k_and_v_into_their_slots(kernels, dtype):
    t = 4
    qkv = torch.randn(t, (H + 2 * KV) * D).to(dtype)
    cos, sin = torch.randn(t, 1, D).to(dtype), torch.randn(t, 1, D).to(dtype)
    rotated = apply_rotary(qkv[:, : (H + KV) * D].view(t, -1, D), (cos, sin)).reshape(t, -1)
    v = qkv[:, (H + KV) * D :].clone()
    cache = torch.zeros(32, 2, KV, D, dtype=dtype)
    slots = torch.tensor([3, 17, 4, 30])
    kernels.rotary_store(qkv, H, KV, D, cos, sin, cache, slots)
    torch.testing.assert_close(qkv[:, : (H + KV) * D], rotated, atol=EXACT[dtype], rtol=1e-6)
    assert torch.equal(cache[slots, 0].reshape(t, -1), qkv[:, H * D : (H + KV) * D])
    assert torch.equal(cache[slots, 1].reshape(t, -1), v)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert not cache[untouched].any()  # no other slot written


@DTYPES
# 64 (and 128) run a variant compiled for that size; 40 is a whole number of AVX2 vectors, not AVX-512 ones
@pytest.mark.parametrize("head_dim", [D, 64, 40])
# few rows: a task per KV head, and per part of a long context (merged after); many rows: per row
@pytest.mark.parametrize("many_rows,long_context", [(False, False), (True, False), (False, True), (True, True)])
def test_decode_attention_reads_each_rows_own_context(kernels, dtype, head_dim, many_rows, long_context):
    block, num_blocks, g = 4, 20, torch.Generator().manual_seed(3)
    rows = 2 * torch.get_num_threads() + 1 if many_rows else 3
    table_len = 200 if long_context else 5  # up to 800 cached tokens: several parts of 128 or more
    cache = torch.randn(num_blocks * block, 2, KV, head_dim, generator=g).to(dtype)
    tables = torch.randint(0, num_blocks, (rows, table_len), generator=g)
    lens = torch.randint(1, table_len * block + 1, (rows,), generator=g)
    if long_context:
        lens[0] = table_len * block  # the longest, split among every thread
    q = torch.randn(rows, H + 2 * KV, head_dim, generator=g).to(dtype)[:, :H]  # strided, as qkv's q heads are
    out = kernels.decode_attention(q, cache, block, tables, lens, head_dim**-0.5)
    for r in range(rows):
        slots = torch.tensor([tables[r, j // block] * block + j % block for j in range(lens[r])])
        k, v = cache[slots, 0].float(), cache[slots, 1].float()  # [len, KV, D]
        ref = F.scaled_dot_product_attention(q[r].float().unsqueeze(1), k.transpose(0, 1).repeat_interleave(H // KV, 0),
                                             v.transpose(0, 1).repeat_interleave(H // KV, 0), scale=head_dim**-0.5)
        # float32 throughout; a bfloat16 result is rounded once (2^-9 of its size)
        tol = 1e-5 if dtype == torch.float32 else 2**-8
        torch.testing.assert_close(out[r].float().view(H, head_dim), ref.squeeze(1), atol=tol, rtol=tol)


@pytest.fixture
def amx_kernels():
    kernels = native.load()
    if kernels is None or not kernels.qmatmul_amx_available:
        pytest.skip("attention on AMX tiles: this CPU (or build) has no AMX for bfloat16")
    return kernels


@pytest.fixture(params=list(native.PREFILL_ATTENTION_KINDS))
def prefill(request):
    """pdserve's prefill attention by each of its kernels this CPU runs: AMX tiles, AVX512-BF16 dot
    products (an AMX CPU runs both), as a function of the kernel's arguments."""
    kernels = native.load()
    if kernels is None or request.param not in kernels.prefill_attention_kinds:
        needs = "AMX for bfloat16" if request.param == "tiles" else "AVX512-BF16"
        pytest.skip(f"prefill attention in {request.param}: this CPU (or build) has no {needs}")
    return functools.partial(kernels.prefill_attention, kind=request.param)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
# (context, chunk): a whole prompt of partial blocks; a chunk after cached tokens; one token; one
# whole block of queries past a long context
@pytest.mark.parametrize("context_len,query_len", [(77, 77), (300, 45), (40, 1), (545, 16)])
def test_prefill_attention_is_causal_over_the_paged_context(prefill, head_dim, context_len, query_len):
    block, g = 16, torch.Generator().manual_seed(5)
    blocks_needed = -(-context_len // block)
    # stale values (even NaN) past the context in its last block must not reach the output
    cache = torch.randn((blocks_needed + 3) * block, 2, KV, head_dim, generator=g).to(torch.bfloat16)
    table = torch.randperm(blocks_needed + 3, generator=g)[:blocks_needed]
    tail = table[-1] * block + context_len % block
    if context_len % block:
        cache[tail : table[-1] * block + block] = float("nan")
    qkv = torch.randn(query_len, H + 2 * KV, head_dim, generator=g).to(torch.bfloat16)
    q = qkv[:, :H]  # strided, as qkv's q heads are
    out = torch.full((query_len, H, head_dim), float("nan"), dtype=torch.bfloat16)
    prefill(q, cache, block, table, context_len, head_dim**-0.5, out)
    slots = (table.repeat_interleave(block) * block + torch.arange(block).repeat(blocks_needed))[:context_len]
    k, v = (cache[slots, i].float().transpose(0, 1).repeat_interleave(H // KV, 0) for i in (0, 1))
    seen = torch.ones(query_len, context_len, dtype=torch.bool).tril(context_len - query_len)
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=seen, scale=head_dim**-0.5)
    # P is rounded to bfloat16 before its product with V, as torch's flash attention does
    torch.testing.assert_close(out.float(), ref.transpose(0, 1), atol=2**-7, rtol=2**-7)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("order", ["rising", "falling"])
def test_prefill_attention_follows_scores_that_rise_or_fall_along_the_keys(prefill, head_dim, order):
    """Rising scores move each query's running maximum past the rescale threshold step after step
    (its output rescaled many times); falling ones set it at the first key and never move it."""
    context_len, block, g = 200, 16, torch.Generator().manual_seed(7)
    direction = torch.randn(head_dim, generator=g)
    weight = torch.linspace(-12, 12, context_len) if order == "rising" else torch.linspace(12, -12, context_len)
    cache = torch.empty(context_len, 2, KV, head_dim)
    cache[:, 0] = (weight[:, None] * direction)[:, None] + 0.1 * torch.randn(context_len, KV, head_dim, generator=g)
    cache[:, 1] = torch.randn(context_len, KV, head_dim, generator=g)
    cache = cache.to(torch.bfloat16)
    table = torch.arange(context_len // block + 1)
    cache = torch.cat([cache, torch.zeros(block - context_len % block, 2, KV, head_dim, dtype=torch.bfloat16)])
    q = (direction + 0.1 * torch.randn(context_len, H, head_dim, generator=g)).to(torch.bfloat16)
    out = torch.empty(context_len, H, head_dim, dtype=torch.bfloat16)
    prefill(q, cache, block, table, context_len, head_dim**-0.5, out)
    k, v = (cache[:context_len, i].float().transpose(0, 1).repeat_interleave(H // KV, 0) for i in (0, 1))
    seen = torch.ones(context_len, context_len, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=seen, scale=head_dim**-0.5)
    torch.testing.assert_close(out.float(), ref.transpose(0, 1), atol=2**-7, rtol=2**-7)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
# few rows: a row's context split among the threads (parts merged after); many rows: a task each
@pytest.mark.parametrize("rows,longest", [(1, 1000), (3, 300), (9, 200)])
def test_decode_attention_on_amx_tiles_reads_each_rows_paged_context(amx_kernels, head_dim, rows, longest):
    block, g = 16, torch.Generator().manual_seed(11)
    lens = torch.randint(1, longest + 1, (rows,), generator=g)
    lens[0], lens[-1] = longest, 5  # the longest; one shorter than a group of 16 keys
    blocks = -(-lens // block)
    table_len = int(blocks.max())
    num_blocks = int(blocks.sum())
    cache = torch.randn(num_blocks * block, 2, KV, head_dim, generator=g).to(torch.bfloat16)
    order = torch.randperm(num_blocks, generator=g)  # each row's blocks scattered over the cache
    tables = torch.zeros(rows, table_len, dtype=torch.int64)
    taken = 0
    for r in range(rows):
        tables[r, : blocks[r]] = order[taken : taken + blocks[r]]
        taken += int(blocks[r])
        if lens[r] % block:  # stale values (even NaN) past the context in its last block
            last = int(tables[r, blocks[r] - 1])
            cache[last * block + lens[r] % block : (last + 1) * block] = float("nan")
    q = torch.randn(rows, H + 2 * KV, head_dim, generator=g).to(torch.bfloat16)[:, :H]
    out = amx_kernels.decode_attention(q, cache, block, tables, lens, head_dim**-0.5)
    for r in range(rows):
        slots = torch.tensor([tables[r, j // block] * block + j % block for j in range(lens[r])])
        k, v = (cache[slots, i].float().transpose(0, 1).repeat_interleave(H // KV, 0) for i in (0, 1))
        ref = F.scaled_dot_product_attention(q[r].float().unsqueeze(1), k, v, scale=head_dim**-0.5)
        # weights rounded to bfloat16 before their product with V, as in prefill
        torch.testing.assert_close(out[r].float().view(H, head_dim), ref.squeeze(1), atol=2**-7, rtol=2**-7)


@pytest.mark.parametrize("order", ["rising", "falling"])
def test_decode_attention_on_amx_tiles_follows_scores_that_rise_or_fall(amx_kernels, order):
    """A running maximum that moves key after key (rising), or is set at the first (falling)."""
    context_len, block, head_dim, g = 300, 16, 64, torch.Generator().manual_seed(13)
    direction = torch.randn(head_dim, generator=g)
    weight = torch.linspace(-12, 12, context_len) if order == "rising" else torch.linspace(12, -12, context_len)
    blocks = -(-context_len // block)
    cache = torch.randn(blocks * block, 2, KV, head_dim, generator=g)
    cache[:context_len, 0] = (weight[:, None] * direction)[:, None] + 0.1 * cache[:context_len, 0]
    cache = cache.to(torch.bfloat16)
    q = (direction + 0.1 * torch.randn(2, H, head_dim, generator=g)).to(torch.bfloat16)
    tables, lens = torch.arange(blocks).repeat(2, 1), torch.tensor([context_len, context_len - 37])
    out = amx_kernels.decode_attention(q, cache, block, tables, lens, head_dim**-0.5)
    for r in range(2):
        k, v = (cache[: lens[r], i].float().transpose(0, 1).repeat_interleave(H // KV, 0) for i in (0, 1))
        ref = F.scaled_dot_product_attention(q[r].float().unsqueeze(1), k, v, scale=head_dim**-0.5)
        torch.testing.assert_close(out[r].float().view(H, head_dim), ref.squeeze(1), atol=2**-7, rtol=2**-7)


def test_prefill_attention_runs_only_with_the_avx512_variant(prefill):
    kernels = prefill.func.__self__
    for name in kernels.supported:
        assert kernels.with_isa(name).prefill_attention_available == (name == "avx512_vnni")
    q = torch.randn(4, H, 32).to(torch.bfloat16)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="refused"):  # blocks of 8 tokens: a group of 16 keys spans two
        prefill(q, torch.zeros(16, 2, KV, 32, dtype=torch.bfloat16), 8, torch.tensor([0]), 4, 1.0, out)
    with pytest.raises(ValueError, match="whole heads"):
        prefill(q.transpose(1, 2), torch.zeros(16, 2, KV, 32, dtype=torch.bfloat16), 16, torch.tensor([0]), 4, 1.0,
                out)
    with pytest.raises(ValueError, match="one of tiles, vectors"):
        kernels.prefill_attention(q, torch.zeros(16, 2, KV, 32, dtype=torch.bfloat16), 16, torch.tensor([0]), 4, 1.0,
                                  out, kind="gpu")


def test_what_the_kernels_cannot_take_is_refused(kernels):
    with pytest.raises(ValueError, match="contiguous"):
        kernels.rms_norm(torch.randn(4, 8).t(), torch.ones(4), 1e-6)
    lens = torch.tensor([9])  # longer than its table holds
    with pytest.raises(RuntimeError, match="refused"):
        kernels.decode_attention(torch.randn(1, H, D), torch.zeros(8, 2, KV, D), 4, torch.tensor([[0, 1]]), lens, 1.0)


def test_none_turns_them_off(monkeypatch):
    monkeypatch.setenv(native.ISA_ENV, "none")
    assert native.load.__wrapped__() is None


def test_a_thread_made_serial_runs_torch_alone_and_leaves_the_others_as_they_were():
    if native.load() is None:
        pytest.skip("pdserve's CPU kernels do not build here")
    before = torch.get_num_threads()
    seen: list[int] = []

    def transfer_thread() -> None:
        native.serial_torch_on_this_thread()
        seen.append(torch.get_num_threads())
        torch.ones(1 << 20).add_(1)  # an operator large enough to go parallel runs anyway

    t = threading.Thread(target=transfer_thread)
    t.start()
    t.join()
    assert seen == [1]
    assert torch.get_num_threads() == before


def test_a_team_is_pinned_one_thread_a_core_only_where_it_owns_exactly_its_cores(monkeypatch):
    if native.load() is None:
        pytest.skip("pdserve's CPU kernels do not build here")
    allowed = sorted(os.sched_getaffinity(0))
    seen: dict[str, object] = {}

    def engine_thread(key: str) -> None:  # a thread of its own: its team, its mask
        seen[key] = (native.bind_team_to_cores(), os.sched_getaffinity(0))

    for threads, key in ((len(allowed), "owns"), (len(allowed) + 1, "shares")):
        monkeypatch.setattr(native.torch, "get_num_threads", lambda: threads)
        t = threading.Thread(target=engine_thread, args=(key,))
        t.start()
        t.join(30)
    assert seen["owns"] == (True, {allowed[0]})  # the caller on the first CPU, the team's others after
    assert seen["shares"] == (False, set(allowed))  # more threads than CPUs: left to the scheduler
    assert os.sched_getaffinity(0) == set(allowed)  # other threads keep theirs
