"""Turns a scheduler step into tensors, runs the model over the paged KV cache, samples."""

from __future__ import annotations

from typing import Callable

import torch

from pdserve.engine.compiled_step import CompiledDecode
from pdserve.engine.request import Request
from pdserve.engine.spec.verify import verified
from pdserve.engine.step import SchedulerOutput
from pdserve.engine.step_plan import step_plan
from pdserve.engine.structured import mask_logits
from pdserve.layers.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from pdserve.layers.kernels import native
from pdserve.layers.penalties import RowPenalties, apply_penalties
from pdserve.layers.sampler import Sampler, SamplingBatch, skip_draws, token_logprobs
from pdserve.models.draft_head import DraftHead
from pdserve.models.llama import LlamaForCausalLM
from pdserve.outputs import TokenLogprobs

PROMPT_LOGPROB_ROWS = 256  # prompt positions put through the head at once: 256 x a 50k vocabulary is 50 MB


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype, extra_layers: int = 0) -> int:
    """Bytes of one block of the paged cache: the model's layers (every rank's heads, under tensor
    parallelism on a CPU: one pool holds them all), and `extra_layers` more (a draft head's)."""
    cfg = model.cfg
    layers = cfg.num_layers * pool_ranks(model)[0] + extra_layers
    return 2 * layers * block_size * cfg.kv_size * torch.finfo(dtype).bits // 8


def pool_ranks(model: LlamaForCausalLM) -> tuple[int, int]:
    """(ranks whose KV one pool holds, this rank's place among them). On a CPU a tensor-parallel
    worker's ranks share one pool: layer i of rank r is its layer `i * ranks + r`, each rank's
    heads one contiguous layer, so the pool is what a worker of as many ranks ships and keeps,
    block for block. On GPUs each rank holds its own cache (1, 0)."""
    ranks = getattr(model, "ranks", None)  # (a stand-in model of shapes alone has none)
    if ranks is None or ranks.device.type != "cpu":
        return 1, 0
    return ranks.size, ranks.rank


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
        compile_decode: bool = False,
        use_kernels: bool = True,  # pdserve's CPU kernels where they apply (False: torch's throughout)
        head: DraftHead | None = None,  # a draft head (`models/draft_head.py`): its layer is one more in the cache
    ) -> None:
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.head = head
        model.keep_residual = head is not None and not head.reads_final_norm
        # [layers, slots, K/V, kv_heads, head_dim]; one slot per token position of a block
        n, rank = pool_ranks(model)
        shape = (cfg.num_layers * n + (head is not None), num_blocks * block_size, 2, cfg.num_kv_heads, cfg.head_dim)
        if kv_allocator is not None:  # e.g. in shared memory, for a same-host prefill worker to fill
            self.kv_cache = kv_allocator(shape, dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        # the layers this process computes: its own rank's, where the pool holds several (`pool_ranks`)
        self.layer_kv = self.kv_cache if n == 1 else self.kv_cache.view(cfg.num_layers, n, *shape[1:])[:, rank]
        self.sampler = Sampler(seed)
        self.compiled = CompiledDecode(model, self.kv_cache) if compile_decode else None
        # pdserve's CPU kernels for norms, rotary, cache writes and decode attention; a compiled
        # decode graph has torch compute them (one metadata form for both kinds of step)
        usable = (use_kernels and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                  and not compile_decode)
        self.kernels = native.load() if usable else None

    @torch.inference_mode()
    def forward(
        self, step: SchedulerOutput, on_layer: Callable[[int], None] | None = None
    ) -> tuple[torch.Tensor | None, list[tuple[int, int]]]:
        """Runs the step's tokens; returns the logits ([rows, vocab] float32) of the positions
        that sample, and which: for each request whose chunk reached the end of its known tokens,
        its row in the step and 1 (its last position), or for one verifying a draft, its row and
        `1 + len(draft)` (its last token and each draft). `on_layer(i)` is called as soon as layer
        i's KV for the step is in the cache."""
        if self.model.ranks is not None:  # tensor parallel: the other ranks run the same step
            self.model.ranks.send_step(step_plan(step, self.block_size))
        input_ids, positions, meta, heads, logits_index = self._prepare(step)
        plain = not meta.prefills and len(heads) == len(step.requests) and len(logits_index) == len(heads)
        if self.compiled is not None and on_layer is None and plain:
            logits = self.compiled(input_ids, positions, meta)
            if logits is not None:
                return logits, heads
        hidden = self.model(input_ids, positions, self.layer_kv, meta, on_layer)
        if self.head is not None:  # what the head's pass reads once the step has sampled
            self._features = (hidden if self.head.reads_final_norm else self.model.residual, positions, meta)
        if any(r.prompt_logprobs is not None for r in step.requests[step.num_decodes :]):
            self._prompt_logprobs(step, hidden)
        if not heads:
            return None, heads
        return self.model.compute_logits(hidden[logits_index]), heads

    @torch.inference_mode()
    def run_layers(self, step: SchedulerOutput) -> None:
        """The step's layers alone, their KV into this cache: a tensor-parallel rank other than 0
        (rank 0 asks for logits itself, when it needs them)."""
        input_ids, positions, meta, _, _ = self._prepare(step)
        self.model(input_ids, positions, self.layer_kv, meta)

    def execute(self, step: SchedulerOutput, on_layer: Callable[[int], None] | None = None
                ) -> list[int | list[int] | None]:
        """Runs the step; returns the sampled token of each request whose chunk reached its end,
        and for one verifying a draft the tokens it gives (`verified`); each token's
        log-probabilities, where asked for, go to the request's `pending_logprobs`."""
        logits, heads = self.forward(step, on_layer)
        sampled: list[int | list[int] | None] = [None] * len(step.requests)
        if logits is None:
            if self.head is not None:
                self._head_pass(step, {})
            return sampled
        positions = [(step.requests[row], step.requests[row].draft[:j]) for row, count in heads for j in range(count)]
        seeded = {row: step.requests[row].generator.get_state() for row, count in heads
                  if count > 1 and step.requests[row].generator is not None}
        tokens = self.sample(logits, positions)
        entries = self._logprobs(logits, positions, tokens)
        drawn: dict[int, list[int]] = {}  # each sampling row's tokens, for a draft head's pass
        at = 0
        for row, count in heads:
            req = step.requests[row]
            drawn[row] = tokens[at : at + count]
            if count > 1:
                new = sampled[row] = verified(req.draft, tokens[at : at + count])
            else:
                new, sampled[row] = tokens[at : at + 1], tokens[at]
            if entries[at] is not None:
                req.pending_logprobs = entries[at : at + len(new)]
            if row in seeded:  # its generator drew for every position: as if it drew for the kept ones
                req.generator.set_state(seeded[row])
                if not req.params.greedy:
                    skip_draws(req.generator, logits.shape[1], len(new))
            at += count
        if self.head is not None:
            self._head_pass(step, drawn, sampled)
        return sampled

    # -- a draft head (`models/draft_head.py`) --------------------------------------------------

    def _head_pass(self, step: SchedulerOutput, samples: dict[int, list[int]],
                   sampled: list[int | list[int] | None] | None = None) -> None:
        """The head's layer over every row the step computed: its KV for each position (the
        model's feature there and the token after it: the request's own, else the one sampled at
        that row), and for each request that sampled, the head's feature at its last kept
        position (`Request.head_feature`), which its next drafts start from."""
        features, positions, meta = self._features
        self._features = None
        next_ids: list[int] = []
        last_rows: dict[int, int] = {}  # request's row in the step -> its last kept row among all rows
        offset = 0
        for row, (req, n) in enumerate(zip(step.requests, step.num_new_tokens)):
            start, known = req.num_computed_tokens, req.num_tokens
            drawn = samples.get(row, [])
            for p in range(start, start + n):
                if p + 1 < known:
                    next_ids.append(req.token_ids(p + 1, p + 2)[0])
                else:  # its last token's row, or a draft's: the token the model sampled there
                    j = p - (known - 1)
                    next_ids.append(drawn[j] if j < len(drawn) else 0)  # rows past a rejection: written again
            if row in samples:
                kept = sampled[row]
                kept_count = len(kept) if isinstance(kept, list) else 1
                last_rows[row] = offset + (known - 1 - start) + kept_count - 1
            offset += n
        out = self.head(features, torch.tensor(next_ids, device=self.device), self.model.embed_tokens,
                        self.model.rotary(positions), self.kv_cache[-1], meta)
        for row, at in last_rows.items():
            step.requests[row].head_feature = out[at].clone()

    @torch.inference_mode()
    def head_step(self, step: SchedulerOutput, features: torch.Tensor) -> torch.Tensor:
        """One drafting step of the head: each of the step's requests (one row: its draft token at
        its position) from its feature ([rows, hidden]); their next features."""
        input_ids, positions, meta, _, _ = self._prepare(step)
        return self.head(features, input_ids, self.model.embed_tokens, self.model.rotary(positions),
                         self.kv_cache[-1], meta)

    def head_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The model's logits ([rows, vocab] float32) of features the head gave."""
        return self.model.compute_logits(self.head.logits_input(features))

    def sample(self, logits: torch.Tensor, positions: list[tuple[Request, list[int]]]) -> list[int]:
        """One token for each position: a request and the drafts ahead of the position, which
        count as its output so far. From the position's row of `logits` ([rows, vocab] float32),
        after its penalties and biases (`layers/penalties.py`) and its structure's mask."""
        requests = [r for r, _ in positions]
        if any(r.params.penalized for r in requests):
            logits = apply_penalties(logits, [RowPenalties(r.params, r.prompt_token_ids, r.output_token_ids + ahead)
                                              if r.params.penalized else None for r, ahead in positions])
        if any(r.matcher is not None for r in requests):
            logits = mask_logits(logits, [(r.matcher, ahead) if r.matcher is not None else None
                                          for r, ahead in positions])
        return self.sampler(logits, sampling_batch(requests, self.device))

    @staticmethod
    def _logprobs(logits: torch.Tensor, positions: list[tuple[Request, list[int]]], tokens: list[int]
                  ) -> list[TokenLogprobs | None]:
        """Each asking position's token's log-probabilities under the model's own distribution
        (before penalties and masks, as OpenAI reports them)."""
        asked = [i for i, (r, _) in enumerate(positions) if r.params.logprobs is not None]
        entries: list[TokenLogprobs | None] = [None] * len(positions)
        if asked:
            found = token_logprobs(logits[asked], [tokens[i] for i in asked],
                                   [positions[i][0].params.logprobs for i in asked])
            for i, entry in zip(asked, found):
                entries[i] = entry
        return entries

    def _prompt_logprobs(self, step: SchedulerOutput, hidden: torch.Tensor) -> None:
        """Each asking request's prompt log-probabilities at the positions this step computed: row
        p's logits give token p + 1's. Rows go through the head a slice at a time, so a long
        chunk never holds all its logits at once; each entry lands at its own position (a step
        run again writes the same values)."""
        offset = 0
        for req, n in zip(step.requests, step.num_new_tokens):
            start, prompt = req.num_computed_tokens, req.prompt_token_ids
            last = min(start + n, len(prompt) - 1)  # the prompt's last row predicts the first output
            if req.prompt_logprobs is not None and start < last:
                top = req.params.prompt_logprobs
                for lo in range(start, last, PROMPT_LOGPROB_ROWS):
                    hi = min(lo + PROMPT_LOGPROB_ROWS, last)
                    logits = self.model.compute_logits(hidden[offset + lo - start : offset + hi - start])
                    entries = token_logprobs(logits, prompt[lo + 1 : hi + 1], [top] * (hi - lo))
                    req.prompt_logprobs[lo + 1 : hi + 1] = entries
            offset += n

    def _prepare(self, step: SchedulerOutput):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        heads: list[tuple[int, int]] = []  # (row, positions that sample): see `forward`
        logits_index: list[int] = []
        for row, (req, n, table) in enumerate(zip(step.requests, step.num_new_tokens, step.block_tables)):
            start = req.num_computed_tokens
            end = start + n
            ids.extend(req.token_ids(start, end))
            pos.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if req.draft:  # its last token and each draft: what the model samples after every one
                heads.append((row, len(req.draft) + 1))
                logits_index.extend(range(len(ids) - len(req.draft) - 1, len(ids)))
            elif end == req.num_tokens:
                heads.append((row, 1))
                logits_index.append(len(ids) - 1)
        dev = self.device
        decode_rows = sum(step.num_new_tokens[: step.num_decodes])  # one a request, or 1 + its draft
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev),
            block_size=bs,
            num_decode_tokens=decode_rows,
            kernels=self.kernels,
        )
        if step.num_decodes:
            self._decode_metadata(step, meta)
        offset = decode_rows
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
            heads,
            torch.tensor(logits_index, device=dev),
        )

    def _decode_metadata(self, step: SchedulerOutput, meta: AttentionMetadata) -> None:
        nd = step.num_decodes
        # a row per token: a request verifying a draft has one for its last token and one for each
        # draft, each over the context up to its own position (the step writes their KV first)
        lens, tables = [], []
        for r, n, table in zip(step.requests[:nd], step.num_new_tokens[:nd], step.block_tables[:nd]):
            lens += [r.num_computed_tokens + 1 + j for j in range(n)]
            tables += [table] * n
        if meta.kernels is not None:  # each row over its own context: only the tables need padding
            max_blocks = -(-max(lens) // self.block_size)
            meta.decode_tables = torch.tensor([t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks]))
                                               for t in tables])
            meta.decode_lens = torch.tensor(lens)
            return
        groups = decode_groups(lens)
        if len(groups) == 1:  # the usual case: every row in its own place, no reordering
            meta.decode_groups.append(self._decode_group(None, lens, tables))
            return
        for rows in groups:
            meta.decode_groups.append(self._decode_group(rows, [lens[i] for i in rows], [tables[i] for i in rows]))

    def _decode_group(self, rows: list[int] | None, lens: list[int], tables: list[list[int]]) -> DecodeGroup:
        max_len = max(lens)
        max_blocks = -(-max_len // self.block_size)
        padded = [t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks])) for t in tables]
        mask = None
        if min(lens) != max_len:
            valid = torch.arange(max_len, device=self.device) < torch.tensor(lens, device=self.device).unsqueeze(1)
            mask = valid.view(len(lens), 1, 1, max_len)
        return DecodeGroup(None if rows is None else torch.tensor(rows, device=self.device),
                           torch.tensor(padded, device=self.device), max_len, mask,
                           torch.tensor(lens, device=self.device), min(lens))

    def _prefill_chunk(self, query_start: int, start: int, n: int, table: list[int]) -> PrefillChunk:
        context_len = start + n
        num_blocks = -(-context_len // self.block_size)
        blocks = torch.tensor(table[:num_blocks], device=self.device)
        mask = None
        if start:  # query i (position start+i) sees keys 0..start+i
            q_pos = torch.arange(start, context_len, device=self.device).unsqueeze(1)
            unseen = torch.arange(context_len, device=self.device).unsqueeze(0) > q_pos
            mask = torch.zeros(unseen.shape, dtype=self.dtype, device=self.device).masked_fill_(unseen, -torch.inf)
        return PrefillChunk(query_start, n, context_len, blocks, mask)


def sampling_batch(requests: list[Request], device: torch.device) -> SamplingBatch | None:
    """The requests' sampling settings as the sampler takes them, one row each. None when every
    request is greedy (most decode steps): the sampler then only takes the argmax, and building
    nothing here keeps that step cheap."""
    if all(r.params.greedy for r in requests):
        return None
    params = [r.params for r in requests]
    batch = SamplingBatch(
        greedy=torch.tensor([p.greedy for p in params], device=device),
        temperatures=_float_row([1.0 if p.greedy else p.temperature for p in params], device),
        generators=[r.generator for r in requests],
    )
    if any(p.top_k for p in params):
        batch.top_ks = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
    if any(p.top_p < 1.0 for p in params):
        batch.top_ps = _float_row([p.top_p for p in params], device)
    if any(p.min_p for p in params):
        batch.min_ps = _float_row([p.min_p for p in params], device)
    return batch


def _float_row(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def decode_groups(lens: list[int], max_waste: float = 2.0, min_pad: int = 512) -> list[list[int]]:
    """The decodes' rows grouped by context length, shortest first: a group takes lengths up to
    `max_waste` times its shortest (or its shortest + `min_pad`, for short contexts, where a call
    costs more than the padding), so padding never makes a row read much more than its own context.
    Lengths that are all alike make one group."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        first = lens[groups[-1][0]] if groups else 0
        if groups and lens[i] <= max(max_waste * first, first + min_pad):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
