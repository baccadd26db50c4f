"""The engine: requests in, incremental outputs out, one `step()` at a time.

Each step reads as schedule -> run -> postprocess. Servers call `add_request`, `step` and `abort`
from one thread; `pdserve.LLM` wraps the same calls for offline use.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable

import torch

from pdserve.config import EngineConfig, resolve_device
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.completions import Completion, Completions, make_detokenizer
from pdserve.engine.model_runner import ModelRunner, kv_bytes_per_block
from pdserve.engine.isolation import run_isolating
from pdserve.engine.kv_tier import make_tiers
from pdserve.engine.model_load import load as load_model
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.role import RoleHooks
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.spec.draft import DraftModelProposer
from pdserve.engine.spec.head import HeadProposer, feature_from_wire
from pdserve.engine.spec.proposers import make_proposer
from pdserve.engine.step import SchedulerOutput
from pdserve.engine.structured import Structures
from pdserve.engine.warm_up import warm_up
from pdserve.layers.sampler import skip_draws
from pdserve.limits import MAX_ABS_PRIORITY
from pdserve.models.arch_config import model_fingerprint
from pdserve.models.draft_head import load_draft_head
from pdserve.outputs import RequestOutput, TokenLogprobs
from pdserve.sampling_params import SamplingParams

log = logging.getLogger("pdserve.engine")

PromptInput = str | dict[str, Any]  # text, or {"prompt_token_ids": [...]} / {"prompt": "..."}


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        hooks: RoleHooks | None = None,
        kv_allocator: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = resolve_device(config.device)
        self.hooks = hooks or RoleHooks()
        self.on_schedule: Callable[[SchedulerOutput], None] | None = None  # sees each step before it runs
        loaded = load_model(config, device, LLMEngine)
        ckpt, model, compile_decode, head_path = loaded.checkpoint, loaded.model, loaded.compile_decode, loaded.head_path
        self.ranks = loaded.ranks  # tensor parallel: the other ranks (`close` stops them)
        self.tokenizer = ckpt.tokenizer
        self.model_config = loaded.arch
        self.dtype = loaded.dtype
        head = load_draft_head(head_path, self.model_config, self.dtype, device) if head_path else None
        self.max_model_len = loaded.max_model_len(config)
        block_bytes = kv_bytes_per_block(model, config.block_size, self.dtype, head is not None)
        num_blocks = config.kv_cache_memory // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={config.kv_cache_memory} bytes holds no KV block of this model; raise it"
            )
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        if self.ranks is not None and kv_allocator is None and device.type == "cpu":
            kv_allocator = self.ranks.pool  # one the other ranks can map
        self.runner = ModelRunner(model, num_blocks, config.block_size, self.dtype, device, config.seed, kv_allocator,
                                  compile_decode=compile_decode, head=head)
        if self.ranks is not None:
            self.ranks.share_pool(self.runner.kv_cache, num_blocks)
        self.block_manager.tier = make_tiers(config, self.runner.kv_cache, block_bytes,
                                             f"{model_fingerprint(self.model_config)}:{head.name if head else ''}")
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            loaded.eos_token_ids(),
            self.hooks,
            config.decode_headroom_tokens,
            config.max_queue_wait_s if config.shortest_prompt_first else None,
            proposer=make_proposer(config.speculative, config.num_speculative_tokens,
                                   lambda path, k: DraftModelProposer.load(
                                       path, config.draft_quantization, self.model_config, self.tokenizer,
                                       self.dtype, device, config.block_size, config.kv_cache_memory // 4, k),
                                   lambda k: HeadProposer(self.runner, self.block_manager, k)),
        )
        self.structures = Structures(self.tokenizer, self.model_config.vocab_size, 
                                     tuple(sorted(self.scheduler.eos_token_ids)))
        self._parents: dict[str, Completions] = {}
        self._sequences: dict[str, tuple[Completions, Completion]] = {}  # by engine request id
        self._aborted: list[RequestOutput] = []
        self._landed: list[Request] = []  # got their first token from a prefill worker
        self._ids = itertools.count()
        self.num_aborted = 0  # requests ended by abort() while live, since start
        self.num_failed = 0  # requests that failed a step on their own, since start

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        priority: int = 0,
        remote_prefill: bool = False,
        output_token_ids: list[int] = (),
        arrival_time: float | None = None,
        resume_of: str | None = None,
    ) -> str:
        """Queue a request. With `remote_prefill` (decode role, n == 1) its prompt's KV is
        reserved for a prefill worker to fill; `kv_landed` / `kv_failed` tell how that went.

        `output_token_ids` resumes a request that another worker began (a migration): those tokens
        count as generated (against max_tokens and min_tokens, for stop strings, and for a seeded
        request's random draws), are computed again with the prompt, and are not output again.
        `arrival_time` (time.monotonic()) is when a server received it; default: now. `resume_of`:
        its id on this worker before the worker restarted (its KV may have outlived it)."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("a request id is a non-empty string")
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > MAX_ABS_PRIORITY:
            raise ValueError(f"priority must be an integer in [-{MAX_ABS_PRIORITY}, {MAX_ABS_PRIORITY}]")
        text, token_ids = self._tokenize(prompt)
        output_token_ids = list(output_token_ids)
        self._validate_prompt(token_ids, params)
        self._validate_resumed(token_ids, output_token_ids, params)
        # Every completion is built before any is queued: a request joins whole, or not at all.
        parent = Completions(request_id, text, token_ids, [])
        for i in range(params.n):
            child_params = params if params.n == 1 else params.clone(n=1, seed=params.child_seed(i))
            engine_id = request_id if params.n == 1 else f"{request_id}#{i}"
            if engine_id in self._sequences or engine_id in self.scheduler.requests:
                raise ValueError(f"request id {engine_id!r} is already in use")
            req = Request(engine_id, token_ids, child_params, self._max_total_tokens(token_ids, child_params),
                          priority, arrival_time, remote_prefill=remote_prefill and params.n == 1,
                          output_token_ids=output_token_ids, resume_of=resume_of if params.n == 1 else None)
            if child_params.structure is not None:
                req.matcher = self.structures.matcher(child_params.structure, output_token_ids)
            detokenizer = make_detokenizer(self.tokenizer, token_ids, output_token_ids, child_params)
            self._skip_draws(req, len(output_token_ids))
            parent.sequences.append(Completion(req, detokenizer, i, num_tokens_sent=len(output_token_ids),
                                               num_tokens_detokenized=len(output_token_ids)))
        self._parents[request_id] = parent
        for seq in parent.sequences:
            self._sequences[seq.request.request_id] = (parent, seq)
            self.scheduler.add(seq.request)
        return request_id

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError("a prompt is a string, {'prompt': str} or {'prompt_token_ids': list[int]}")

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but the model's maximum length is "
                f"{self.max_model_len} (prompt plus at least one generated token)"
            )
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if len(token_ids) + 1 > capacity:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but the KV cache holds only {capacity}; "
                "raise kv_cache_memory"
            )
        bad_stop = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad_stop is not None:
            raise ValueError(f"stop token id {bad_stop} is outside the vocabulary [0, {vocab})")
        bad_bias = next((t for t in params.logit_bias if t >= vocab), None)
        if bad_bias is not None:
            raise ValueError(f"logit_bias names token id {bad_bias}, outside the vocabulary [0, {vocab})")

    def _validate_resumed(self, token_ids: list[int], output_ids: list[int], params: SamplingParams) -> None:
        if not output_ids:
            return
        if params.n != 1:
            raise ValueError("only a single completion (n=1) can be resumed with output_token_ids")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in output_ids):
            raise ValueError(f"output token ids must be in [0, {vocab})")
        if len(output_ids) >= self._max_total_tokens(token_ids, params) - len(token_ids):
            raise ValueError(f"{len(output_ids)} output tokens already reach the request's length limit")

    def _skip_draws(self, req: Request, num_tokens: int) -> None:
        """Advance a seeded request's generator past `num_tokens` samples drawn elsewhere, so that it
        goes on exactly as if it had sampled them here. (A greedy request never uses its draws.)"""
        if req.generator is not None and not req.params.greedy:
            skip_draws(req.generator, self.model_config.vocab_size, num_tokens)

    def _max_total_tokens(self, token_ids: list[int], params: SamplingParams) -> int:
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        limit = min(self.max_model_len, capacity)
        if params.max_tokens is not None:
            limit = min(limit, len(token_ids) + params.max_tokens)
        return limit

    def abort(self, request_id: str) -> None:
        """End a request at any moment; idempotent. Its final output comes from the next step()."""
        parent = self._parents.get(request_id)
        if parent is None:
            return
        self.num_aborted += 1
        for seq in parent.sequences:
            self.scheduler.finish(seq.request.request_id, RequestStatus.FINISHED_ABORTED)
        self._aborted.append(parent.output(changed=set()))
        self._forget(parent)

    def stop_completion(self, request_id: str, index: int) -> None:
        """End completion `index` of a request of n as stopped (its reader found a stop string in
        the text) while the others go on; idempotent. Ending the last one ends the request."""
        parent = self._parents.get(request_id)
        if parent is None or not 0 <= index < len(parent.sequences):
            return
        req = parent.sequences[index].request
        if req.status.finished:
            return
        self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
        if parent.finished:
            self._aborted.append(parent.output(changed=set()))
            self._forget(parent)

    def kv_landed(self, request_id: str, first_token: int, prefill_times: tuple[float, float] = (0.0, 0.0),
                  first_logprobs: TokenLogprobs | None = None,
                  prompt_logprobs: list[TokenLogprobs | None] | None = None, head_feature: bytes = b"") -> bool:
        """A prefill worker filled the request's reserved blocks and sampled `first_token` (with
        its log-probabilities, and the prompt's, where the request asks for them; ValueError if
        they are missing; and its draft head's feature at the last token, where both workers have
        the head: ValueError for bytes that are none). Its output comes from the next step().
        False if the request is no longer waiting for it."""
        feature = feature_from_wire(head_feature, self.model_config.hidden_size, self.runner) if self.runner.head else None
        req = self.scheduler.kv_landed(request_id, first_token, prefill_times, first_logprobs, prompt_logprobs)
        if req is None:
            return False
        req.head_feature = feature
        self._skip_draws(req, 1)  # the prefill worker drew the new token's noise from the same seed
        self._landed.append(req)
        return True

    @property
    def draft_model(self) -> DraftModelProposer | None:
        """The draft model this engine drafts with (`--speculative draft:PATH`), if any: a KV
        transfer ships its KV beside the target's."""
        proposer = self.scheduler.proposer
        return proposer if isinstance(proposer, DraftModelProposer) else None

    def kv_failed(self, request_id: str) -> None:
        """The prompt's KV will not come: the request computes it here (the colocated path)."""
        self.scheduler.kv_failed(request_id)

    def request_ids(self) -> list[str]:
        return list(self._parents)

    def has_runnable_work(self) -> bool:
        """Would step() do anything now? (Requests awaiting their KV alone do not count.)"""
        s = self.scheduler
        return bool(s.waiting or s.running or self._landed or self._aborted)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents) or bool(self._aborted) or bool(self._landed)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    def close(self) -> None:
        """Stop what the engine started outside this process (tensor-parallel ranks). Idempotent."""
        if self.ranks is not None:
            self.ranks.stop()

    def warm_up(self) -> float:
        """Run what a server's first requests would otherwise wait for (`engine.warm_up`). The engine
        must be idle. Returns the seconds it took."""
        return warm_up(self)

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        if self._landed:
            landed, self._landed = self._landed, []
            outputs += self._postprocess([r for r in landed if r.request_id in self._sequences])
        step = self.scheduler.schedule()
        if self.block_manager.tier is not None:  # prefix blocks found there, into the pool before any step reads them
            self.block_manager.tier.settle()
        if step.empty:
            return outputs
        if self.on_schedule is not None:
            self.on_schedule(step)
        started = time.perf_counter()
        sampled, failed = run_isolating(step, self._execute)
        if step.num_decodes == len(step.requests) and not failed:
            self.scheduler.observe_step(sum(step.num_new_tokens), time.perf_counter() - started)
        for request_id in failed:  # before update: their tokens are not applied
            self._fail(request_id)
        advanced = self.scheduler.update(step, sampled)
        return outputs + self._postprocess(advanced) + self._take_aborted()

    def _execute(self, step: SchedulerOutput) -> list[int | None]:
        on_layer = self.hooks.before_execute(step)
        try:
            return self.runner.execute(step, on_layer)
        finally:
            self.hooks.after_execute(step)

    def _fail(self, engine_id: str) -> None:
        """End the request that owns this sequence (all its completions) with an error."""
        found = self._sequences.get(engine_id)
        if found is None:
            return
        parent = found[0]
        self.num_failed += 1
        for seq in parent.sequences:
            self.scheduler.finish(seq.request.request_id, RequestStatus.FINISHED_ERROR)
        self._aborted.append(parent.output(changed=set()))
        self._forget(parent)

    def _take_aborted(self) -> list[RequestOutput]:
        ended, self._aborted = self._aborted, []
        return ended

    def _postprocess(self, advanced: list[Request]) -> list[RequestOutput]:
        changed: dict[str, set[int]] = {}
        for req in advanced:
            found = self._sequences.get(req.request_id)
            if found is None:
                continue  # its request failed earlier in this step
            parent, seq = found
            try:
                self._detokenize(req, seq)
            except Exception:  # one request's text must not end its batch mates' steps
                log.exception("detokenizing request %s failed", req.request_id)
                self._fail(req.request_id)
                continue
            changed.setdefault(parent.request_id, set()).add(seq.index)
        outputs = []
        for request_id, indices in changed.items():
            parent = self._parents.get(request_id)
            if parent is None:
                continue  # failed after an earlier completion of it advanced
            out = parent.output(indices)
            outputs.append(out)
            if out.finished:
                self._forget(parent)
        return outputs

    def _detokenize(self, req: Request, seq: Completion) -> None:
        """The step's new tokens into the text, one at a time (a verified draft gives several): a
        stop string ends the request at the token that completed it, and tokens after it in the
        same step are dropped, as decoding one token at a time would never have made them."""
        if seq.detokenizer is None:
            return
        new = len(req.output_token_ids) - seq.num_tokens_detokenized
        for i, token in enumerate(req.output_token_ids[seq.num_tokens_detokenized :]):
            seq.detokenizer.add(token)
            seq.num_tokens_detokenized += 1
            stop = seq.detokenizer.stop_string
            if stop is None or (req.status.finished and i == new - 1):
                continue  # no stop string, or the request ended at this very token on its own
            dropped = new - 1 - i
            if dropped:
                del req.output_token_ids[-dropped:]
                if req.params.logprobs is not None:
                    del req.output_logprobs[-dropped:]
            req.stop_reason = stop
            if req.status.finished:  # it ended on its own at a later token of this step
                self.scheduler.restate_finish(req, RequestStatus.FINISHED_STOPPED)
            else:
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            break
        if req.status.finished:
            seq.detokenizer.flush()

    def _forget(self, parent: Completions) -> None:
        self._parents.pop(parent.request_id, None)
        for seq in parent.sequences:
            self._sequences.pop(seq.request.request_id, None)
