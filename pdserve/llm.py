"""Offline generation: `LLM(model).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Sequence

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine, PromptInput
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer

_ENGINE_FIELDS = {f.name for f in fields(EngineConfig)}


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        unknown = set(engine_args) - _ENGINE_FIELDS
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
        if model is None:
            from pdserve.models.default_model import default_model_path

            model = str(default_model_path())
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args))

    def close(self) -> None:
        """Stop the engine's tensor-parallel ranks, if it has any (they also end with this process)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        ids = []
        try:
            for prompt, p, prio in zip(prompts, params, priorities):
                ids.append(self.engine.add_request(None, prompt, p, prio))
        except Exception:
            for request_id in ids:  # a bad prompt in the batch leaves nothing behind
                self.engine.abort(request_id)
            self.engine.step()
            raise
        return self._run(ids)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        prompts = [
            {"prompt_token_ids": tok.apply_chat_template(c, add_generation_prompt, tokenize=True)}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        wanted = set(ids)
        finals: dict[str, RequestOutput] = {}
        prompt_logprobs: dict[str, list] = {}  # sent once, with a request's first token
        while len(finals) < len(wanted):
            for out in self.engine.step():
                if out.request_id not in wanted:
                    continue
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                if out.finished:
                    out.prompt_logprobs = prompt_logprobs.get(out.request_id)
                    finals[out.request_id] = out
        return [finals[i] for i in ids]
