"""Drafts from a draft model (`--speculative draft:PATH`): a smaller checkpoint with the target's
tokenizer, or the target itself with 4-bit weights (a self-draft), run greedily a few tokens ahead
of each request over a paged KV cache of its own.

At each step the proposer brings every drafting request's sequence on the draft side up to the
request's tokens (a request's first draft: its whole prompt, through the draft as a prefill; later:
the tokens the target verified since its last draft, one or two), then decodes the drafts of all
of them together, one batched step of the draft model a token. A draft the target rejected is
dropped by moving the sequence's computed count back to the last token both agree on: its slots
are written again. The draft's KV lives in its own block pool (a `BlockManager` without prefix
caching), a sequence's blocks freed when its request leaves the running set (the scheduler's
`release`: finished, aborted, moved or preempted); a request the pool has no room for does not draft.

Disaggregated, the prefill worker computes the draft model's prompt KV beside the target's and
ships it in the same lease (`DraftKV`: its layers follow the target's on the wire), into blocks
the decode worker reserved in its draft pool (`reserve`; the worker names the draft's KV by its
`config` and `weights`); once it landed (`adopt`) the decode worker's draft starts from there and
computes no prompt token. A lease that lands without it
(a prefill worker with no draft model, or another one) leaves the decode side to compute it.

A draft is the draft model's most likely token (after the request's `logit_bias`, which
shapes the target's choice as much), one token and not a distribution, so the
verification rule (`engine/spec/__init__.py`) keeps the target's distribution and a seeded
request's output as they are, whatever the draft model is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.model_runner import ModelRunner, kv_bytes_per_block
from pdserve.engine.request import Request
from pdserve.engine.spec.budget import COST_MEMORY
from pdserve.engine.step import SchedulerOutput
from pdserve.models.arch_config import ArchConfig
from pdserve.models.loader import build_model, load_checkpoint
from pdserve.tokenizer import Tokenizer

log = logging.getLogger("pdserve.engine")

CATCH_UP_CHUNK = 2048  # prompt tokens a sequence feeds the draft model in one of its steps, at most
_PROBE_TEXT = "Draft and target must split text alike: 12345 tokens, café, naïve, 東京, def f(x): return x"


@dataclass(slots=True)
class _Sequence:
    """A request's tokens as the draft model holds them, in the form `ModelRunner` reads."""

    request_id: str
    tokens: list[int] = field(default_factory=list)  # the request's tokens, then the drafts fed
    verified: int = 0  # leading `tokens` known to be the request's own
    num_computed_tokens: int = 0  # leading `tokens` whose KV is in the draft's cache
    draft: list[int] = field(default_factory=list)  # the draft model verifies nothing: always empty
    prompt_logprobs: None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # the request's, on the draft's logits too

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_ids(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]

    def follow(self, request: Request) -> None:
        """Take the request's tokens; keep the computed KV of the drafts it accepted."""
        n = request.num_tokens
        new = request.token_ids(self.verified, n)
        agree = 0
        for ours, theirs in zip(self.tokens[self.verified :], new):
            if ours != theirs:
                break
            agree += 1
        # its last token is computed again where the draft had fed it too (a draft cut short before
        # verification, whose next one the target chose): its logits give the next draft
        self.num_computed_tokens = min(self.num_computed_tokens, self.verified + agree, n - 1)
        del self.tokens[self.verified :]
        self.tokens += new
        self.verified = n
        self.logit_bias = request.params.logit_bias


class DraftModelProposer:
    """Proposes each request's next `num_tokens` tokens as the draft model would write them."""

    method = "draft"

    def __init__(self, runner: ModelRunner, blocks: BlockManager, num_tokens: int, config: ArchConfig,
                 weights: str = "") -> None:
        self.runner = runner
        self.blocks = blocks
        self.num_tokens = num_tokens
        self.config = config
        self.weights = weights  # how its weights are held ("int4", "none", "q4_1"...): part of what its KV is
        self.max_len = config.max_position_embeddings  # positions the draft model takes
        self._sequences: dict[str, _Sequence] = {}
        self.prompt_tokens_computed = 0  # prompt tokens the draft model computed here (decode or prefill side)
        self.draft_seconds: float | None = None  # a decode step of the draft model, moving average

    @classmethod
    def load(cls, path: str | Path, quantization: str, target_config: ArchConfig, target_tokenizer: Tokenizer,
             dtype: torch.dtype, device: torch.device, block_size: int, kv_cache_memory: int,
             num_tokens: int) -> DraftModelProposer:
        """The draft model at `path` (a Hugging Face directory or a .gguf file), checked against the
        target's tokenizer, with `kv_cache_memory` bytes of KV of its own."""
        ckpt = load_checkpoint(path)
        cfg = ArchConfig.from_hf_config(ckpt.hf_config)
        if cfg.vocab_size > target_config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({cfg.vocab_size}) is larger than the target's "
                             f"({target_config.vocab_size}): its tokens would not be the target's")
        if (ckpt.tokenizer.backend.get_vocab() != target_tokenizer.backend.get_vocab()
                or ckpt.tokenizer.encode(_PROBE_TEXT) != target_tokenizer.encode(_PROBE_TEXT)):
            raise ValueError(f"the draft model at {str(path)!r} splits text differently from the target: "
                             "a draft model must share the target's tokenizer")
        if quantization == "auto" and device.type == "cpu" and not ckpt.quantized_bits:
            quantization = "int4"  # a dense draft on CPU: its 4-bit weights are what makes it cheap
        model = build_model(ckpt, dtype, device, quantization if device.type == "cpu" else "none")
        num_blocks = kv_cache_memory // kv_bytes_per_block(model, block_size, dtype)
        if num_blocks < 1:
            raise ValueError(f"{kv_cache_memory} bytes hold no KV block of the draft model")
        runner = ModelRunner(model, num_blocks, block_size, dtype, device, seed=0)
        log.info("draft model %s: %d layers, vocabulary %d, %d KV blocks of %d tokens", path, cfg.num_layers,
                 cfg.vocab_size, num_blocks, block_size)
        bits = json.dumps(ckpt.quantized_bits, sort_keys=True, default=str)  # a file's own, per tensor
        weights = f"{quantization if device.type == 'cpu' else 'none'}:{hashlib.sha256(bits.encode()).hexdigest()[:16]}"
        return cls(runner, BlockManager(num_blocks, block_size, enable_prefix_caching=False), num_tokens, cfg,
                   weights)

    # -- the proposer protocol (`engine/spec/__init__.py`) -------------------------------------

    def propose_all(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        """For each (request, limit): at most min(num_tokens, limit) drafts to follow its tokens."""
        drafts: list[list[int]] = [[] for _ in wanted]
        todo: list[tuple[int, _Sequence, int]] = []  # (index in wanted, sequence, drafts it wants)
        for i, (req, limit) in enumerate(wanted):
            k = min(self.num_tokens, limit, self.max_len - req.num_tokens)
            if k < 1:
                continue
            seq = self._sequences.get(req.request_id)
            if seq is None:
                seq = self._sequences[req.request_id] = _Sequence(req.request_id)
            seq.follow(req)
            if not self.blocks.allocate(seq, seq.num_tokens - seq.num_computed_tokens + k - 1):
                self.release(req)  # no room: this request does not draft, and holds nothing here
                continue
            prompt = req.num_prompt_tokens
            self.prompt_tokens_computed += max(0, prompt - seq.num_computed_tokens)
            todo.append((i, seq, k))
        if not todo:
            return drafts
        last = self._catch_up([seq for _, seq, _ in todo])
        for (i, seq, _), token in zip(todo, last):
            drafts[i].append(token)
        for _ in range(1, max(k for _, _, k in todo)):
            going = [(i, seq) for i, seq, k in todo if len(drafts[i]) < k]
            for i, seq in going:
                seq.tokens.append(drafts[i][-1])
            for (i, _), token in zip(going, self._step([seq for _, seq in going])):
                drafts[i].append(token)
        return drafts  # each sequence ends at its next-to-last draft: the last is proposed, not fed

    def _observe(self, seconds: float) -> None:
        old = self.draft_seconds
        self.draft_seconds = seconds if old is None else old + COST_MEMORY * (seconds - old)

    def release(self, request: Request) -> None:
        """The request left the running set: its draft-side KV is freed."""
        self.drop(request.request_id)

    def drop(self, request_id: str) -> None:
        if self._sequences.pop(request_id, None) is not None:
            self.blocks.release(request_id)

    def finished(self, request: Request) -> None:
        """A draft model learns nothing from requests that ended."""

    def forget(self) -> None:
        """Free every sequence (a benchmark's runs start alike)."""
        for request_id in list(self._sequences):
            self.blocks.release(request_id)
        self._sequences.clear()

    # -- disaggregated: the prompt's draft KV from a prefill worker ------------------------------

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Decode side: blocks for the draft KV of a request's first `num_tokens` tokens, which a
        prefill worker is to fill; their ids, or None where the pool has no room (the draft
        computes them here then)."""
        seq = self._sequences.setdefault(request_id, _Sequence(request_id))
        if not self.blocks.allocate(seq, num_tokens):
            self.drop(request_id)
            return None
        return list(self.blocks.block_table(request_id))

    def adopt(self, request: Request, num_tokens: int) -> None:
        """Decode side: the draft KV of the request's first `num_tokens` tokens landed in the
        blocks `reserve` gave."""
        seq = self._sequences.get(request.request_id)
        if seq is not None:
            seq.tokens = request.token_ids(0, num_tokens)
            seq.verified = seq.num_computed_tokens = num_tokens

    def hand_over(self, request_id: str, holder_id: str) -> None:
        """Decode side: a lease ended before its KV landed; its draft blocks go to the holder that
        keeps the target's until no write can reach them (then `release_holder`)."""
        if self._sequences.pop(request_id, None) is not None:
            self.blocks.hand_over(request_id, holder_id)

    def release_holder(self, holder_id: str) -> None:
        self.blocks.release(holder_id)

    def compute_prompts(self, wanted: list[tuple[str, list[int]]]) -> list[tuple[list[int], int, int] | None]:
        """Prefill side: for each (request id, its tokens so far), the draft model's KV of those
        tokens, computed here where not yet: (block table, first position computed now, end);
        None where the pool has no room (that request ships no draft KV)."""
        out: list[tuple[list[int], int, int] | None] = []
        todo: list[_Sequence] = []
        for request_id, tokens in wanted:
            seq = self._sequences.setdefault(request_id, _Sequence(request_id))
            begin = seq.num_computed_tokens
            if not self.blocks.allocate(seq, len(tokens) - begin):
                self.drop(request_id)
                out.append(None)
                continue
            seq.tokens = list(tokens)
            seq.verified = len(tokens)
            self.prompt_tokens_computed += len(tokens) - begin
            out.append((self.blocks.block_table(request_id), begin, len(tokens)))
            if begin < len(tokens):
                todo.append(seq)
        while todo:
            self._step(todo, CATCH_UP_CHUNK)
            todo = [s for s in todo if s.num_computed_tokens < s.num_tokens]
        return out

    # -- the draft model's steps ---------------------------------------------------------------

    def _catch_up(self, sequences: list[_Sequence]) -> list[int]:
        """Feed each sequence its tokens not yet computed (in chunks); the draft model's next token
        after each."""
        last: dict[str, int] = {}
        pending = list(sequences)
        while pending:
            for seq, token in zip(pending, self._step(pending, CATCH_UP_CHUNK)):
                if token is not None:
                    last[seq.request_id] = token
            pending = [s for s in pending if s.num_computed_tokens < s.num_tokens]
        return [last[s.request_id] for s in sequences]

    @torch.inference_mode()
    def _step(self, sequences: list[_Sequence], chunk: int = 1) -> list[int | None]:
        """One step of the draft model: each sequence computes up to `chunk` of its tokens not yet
        computed; the greedy next token of each whose tokens are then all computed (else None)."""
        step = SchedulerOutput()
        counts = [min(chunk, s.num_tokens - s.num_computed_tokens) for s in sequences]
        order = sorted(range(len(sequences)), key=lambda j: counts[j] != 1)  # decodes first
        for j in order:
            step.requests.append(sequences[j])
            step.num_new_tokens.append(counts[j])
            step.block_tables.append(self.blocks.block_table(sequences[j].request_id))
        step.num_decodes = sum(1 for n in counts if n == 1)
        start = time.perf_counter()
        logits, heads = self.runner.forward(step)
        tokens: list[int | None] = [None] * len(sequences)
        if logits is not None:
            vocab = logits.shape[1]
            for i, (row, _) in enumerate(heads):
                for token, bias in step.requests[row].logit_bias.items():
                    if token < vocab:
                        logits[i, token] += bias
            best = logits.argmax(dim=-1).tolist()
            for (row, _), token in zip(heads, best):
                tokens[order[row]] = token
        for seq, n in zip(sequences, counts):
            seq.num_computed_tokens += n
        if max(counts) <= 2:  # a step of drafting (not a prompt caught up): what a draft token costs
            self._observe(time.perf_counter() - start)
        return tokens
