"""Turns a scheduler step into tensors, runs the model over the paged KV cache, samples."""

from __future__ import annotations

from typing import Callable

import torch

from pdserve.engine.scheduler import SchedulerOutput
from pdserve.layers.attention import AttentionMetadata, PrefillChunk
from pdserve.layers.sampler import Sampler
from pdserve.models.llama import LlamaForCausalLM


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.cfg
    return 2 * cfg.num_layers * block_size * cfg.kv_size * torch.finfo(dtype).bits // 8


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int,
        kv_allocator: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.device = device
        # [layers, slots, K/V, kv_heads, head_dim]; one slot per token position of a block
        shape = (cfg.num_layers, num_blocks * block_size, 2, cfg.num_kv_heads, cfg.head_dim)
        if kv_allocator is not None:  # e.g. in shared memory, for a same-host prefill worker to fill
            self.kv_cache = kv_allocator(shape, dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.sampler = Sampler(seed)

    @torch.inference_mode()
    def forward(
        self, step: SchedulerOutput, on_layer: Callable[[int], None] | None = None
    ) -> tuple[torch.Tensor | None, list[int]]:
        """Runs the step's tokens; returns the logits ([rows, vocab] float32) of the requests
        whose chunk reached the end of their known tokens, and those requests' rows in the step.
        `on_layer(i)` is called as soon as layer i's KV for the step is in the cache."""
        input_ids, positions, meta, sample_rows, logits_index = self._prepare(step)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, on_layer)
        if not sample_rows:
            return None, sample_rows
        return self.model.compute_logits(hidden[logits_index]), sample_rows

    def execute(self, step: SchedulerOutput, on_layer: Callable[[int], None] | None = None) -> list[int | None]:
        """Runs the step; returns the sampled token of each request whose chunk reached its end."""
        logits, sample_rows = self.forward(step, on_layer)
        sampled: list[int | None] = [None] * len(step.requests)
        if logits is not None:
            tokens = self.sampler(logits, [step.requests[i] for i in sample_rows])
            for row, token in zip(sample_rows, tokens):
                sampled[row] = token
        return sampled

    def _prepare(self, step: SchedulerOutput):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        last_token_index: list[int] = []
        for row, (req, n, table) in enumerate(zip(step.requests, step.num_new_tokens, step.block_tables)):
            start = req.num_computed_tokens
            end = start + n
            ids.extend(req.token_ids(start, end))
            pos.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if end == req.num_tokens:
                sample_rows.append(row)
                last_token_index.append(len(ids) - 1)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev),
            block_size=bs,
            num_decode_tokens=step.num_decodes,
        )
        if step.num_decodes:
            self._decode_metadata(step, meta)
        offset = step.num_decodes
        for req, n, table in zip(
            step.requests[step.num_decodes :],
            step.num_new_tokens[step.num_decodes :],
            step.block_tables[step.num_decodes :],
        ):
            meta.prefills.append(self._prefill_chunk(offset, req.num_computed_tokens, n, table))
            offset += n
        return (
            torch.tensor(ids, device=dev),
            torch.tensor(pos, device=dev),
            meta,
            sample_rows,
            torch.tensor(last_token_index, device=dev),
        )

    def _decode_metadata(self, step: SchedulerOutput, meta: AttentionMetadata) -> None:
        nd = step.num_decodes
        context_lens = [r.num_computed_tokens + 1 for r in step.requests[:nd]]
        max_len = max(context_lens)
        max_blocks = -(-max_len // self.block_size)
        tables = [t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks])) for t in step.block_tables[:nd]]
        meta.decode_blocks = torch.tensor(tables, device=self.device)
        meta.decode_context_len = max_len
        if min(context_lens) != max_len:
            lens = torch.tensor(context_lens, device=self.device)
            valid = torch.arange(max_len, device=self.device) < lens.unsqueeze(1)
            meta.decode_mask = valid.view(nd, 1, 1, max_len)

    def _prefill_chunk(self, query_start: int, start: int, n: int, table: list[int]) -> PrefillChunk:
        context_len = start + n
        num_blocks = -(-context_len // self.block_size)
        blocks = torch.tensor(table[:num_blocks], device=self.device)
        mask = None
        if start:  # query i (position start+i) sees keys 0..start+i
            q_pos = torch.arange(start, context_len, device=self.device).unsqueeze(1)
            mask = torch.arange(context_len, device=self.device).unsqueeze(0) <= q_pos
        return PrefillChunk(query_start, n, context_len, blocks, mask)
