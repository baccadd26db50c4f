"""`ModelRunner._prepare`: the tensors one step hands the model (token ids, positions, where each
new token's KV is written, padded block tables, masks), checked against values worked out by hand
for a small mixed batch. The model is never run: only its shape sizes the KV cache."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.step import SchedulerOutput
from tests.factories import make_request

BLOCK = 4


def runner(use_kernels: bool = False) -> ModelRunner:
    """torch's decode attention takes groups of padded tables and masks (checked here unless
    `use_kernels`: pdserve's kernel takes every row's table and length)."""
    shape_only = SimpleNamespace(cfg=SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=2))
    return ModelRunner(shape_only, num_blocks=16, block_size=BLOCK, dtype=torch.float32,
                       device=torch.device("cpu"), seed=0, use_kernels=use_kernels)


def request(prompt: list[int], output: list[int], computed: int):
    req = make_request(prompt=prompt, max_tokens=8)
    req.output_token_ids = list(output)
    req.num_computed_tokens = computed
    return req


def test_a_mixed_batch_of_decodes_and_prefill_chunks():
    # decode A: 5 prompt tokens + 1 output, computing position 5 in its second block (7, 2)
    a = request([11, 12, 13, 14, 15], [16], computed=5)
    # decode B: 10 prompt tokens + 2 outputs, computing position 11 in its third block (3, 0, 5)
    b = request(list(range(20, 30)), [30, 31], computed=11)
    # prefill C: a middle chunk, positions 4..8 of 11 (it ends before the prompt does: not sampled)
    c = request(list(range(40, 51)), [], computed=4)
    # prefill D: a whole 3-token prompt from position 0 (sampled)
    d = request([60, 61, 62], [], computed=0)
    step = SchedulerOutput(requests=[a, b, c, d], num_new_tokens=[1, 1, 5, 3], num_decodes=2,
                           block_tables=[[7, 2], [3, 0, 5], [6, 1, 8], [10]])

    ids, pos, meta, heads, logits_index = runner()._prepare(step)

    assert ids.tolist() == [16, 31, 44, 45, 46, 47, 48, 60, 61, 62]
    assert pos.tolist() == [5, 11, 4, 5, 6, 7, 8, 0, 1, 2]
    # slot = block_table[p // 4] * 4 + p % 4
    assert meta.slot_mapping.tolist() == [
        2 * 4 + 1,  # A, p5: its block 1 is 2
        5 * 4 + 3,  # B, p11: its block 2 is 5
        1 * 4 + 0, 1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3,  # C, p4..7: its block 1 is 1
        8 * 4 + 0,  # C, p8: its block 2 is 8
        10 * 4 + 0, 10 * 4 + 1, 10 * 4 + 2,  # D, p0..2: its block 0 is 10
    ]
    assert meta.block_size == BLOCK and meta.num_decode_tokens == 2
    assert heads == [(0, 1), (1, 1), (3, 1)]  # C's chunk does not reach its last token
    assert logits_index.tolist() == [0, 1, 9]

    # decodes of context 6 and 12: one group (12 <= 2 * 6), padded to 12 positions, 3 blocks
    (group,) = meta.decode_groups
    assert group.rows is None and group.context_len == 12
    assert group.blocks.tolist() == [[7, 2, 0], [3, 0, 5]]  # A's table padded with block 0
    assert group.mask.shape == (2, 1, 1, 12)
    assert group.mask[:, 0, 0].tolist() == [[True] * 6 + [False] * 6, [True] * 12]

    chunk_c, chunk_d = meta.prefills
    assert (chunk_c.query_start, chunk_c.query_len, chunk_c.context_len) == (2, 5, 9)
    assert chunk_c.context_blocks.tolist() == [6, 1, 8]
    # query i (position 4 + i) sees keys 0 .. 4 + i
    assert chunk_c.mask.tolist() == [[0.0 if k <= 4 + i else -math.inf for k in range(9)] for i in range(5)]
    assert (chunk_d.query_start, chunk_d.query_len, chunk_d.context_len) == (7, 3, 3)
    assert chunk_d.context_blocks.tolist() == [10] and chunk_d.mask is None  # plainly causal


def test_decodes_of_very_different_lengths_attend_in_groups_of_their_own():
    short = request([1, 2], [3], computed=2)  # context 3
    long = request(list(range(1, 700)), [5], computed=699)  # context 700: past 2x and 3 + 512
    same = request([7, 8], [9], computed=2)  # context 3
    step = SchedulerOutput(requests=[long, short, same], num_new_tokens=[1, 1, 1], num_decodes=3,
                           block_tables=[list(range(175)), [12], [13, 14]])

    _, pos, meta, heads, _ = runner()._prepare(step)

    assert pos.tolist() == [699, 2, 2]
    assert meta.slot_mapping.tolist() == [174 * 4 + 3, 12 * 4 + 2, 13 * 4 + 2]
    assert heads == [(0, 1), (1, 1), (2, 1)]
    first, second = meta.decode_groups  # shortest first, each holding its rows of the step
    assert first.rows.tolist() == [1, 2] and first.context_len == 3 and first.mask is None
    assert first.blocks.tolist() == [[12], [13]]  # one block covers 3 positions: the rest is cut
    assert second.rows.tolist() == [0] and second.context_len == 700
    assert second.blocks.tolist() == [list(range(175))]


def test_for_pdserves_kernel_each_decode_has_its_table_and_length():
    from pdserve.layers.kernels import native

    if native.load() is None:
        import pytest

        pytest.skip("pdserve's CPU kernels do not build here")
    short = request([1, 2], [3], computed=2)  # context 3
    long = request(list(range(1, 10)), [5], computed=9)  # context 10: 3 blocks
    step = SchedulerOutput(requests=[short, long], num_new_tokens=[1, 1], num_decodes=2,
                           block_tables=[[12], [4, 5, 6]])
    _, _, meta, _, _ = runner(use_kernels=True)._prepare(step)
    assert meta.kernels is native.load() and meta.decode_groups == []
    assert meta.decode_tables.tolist() == [[12, 0, 0], [4, 5, 6]] and meta.decode_lens.tolist() == [3, 10]
