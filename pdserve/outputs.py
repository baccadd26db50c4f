"""What generation returns (the shapes of vLLM's RequestOutput / CompletionOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprobs:
    """A generated token's log-probability under the model (before penalties and sampling
    settings), and the most likely tokens' there, most likely first (`SamplingParams.logprobs` of them)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # the whole text, in the request's final output ("" before: streams read delta_text)
    token_ids: list[int]  # the whole completion, in the request's final output ([] before: delta_token_ids)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    delta_text: str = ""  # text new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)  # tokens new since the previous output
    # with `SamplingParams.logprobs`: one for each token generated here, as the tokens are sent
    logprobs: list[TokenLogprobs] | None = None  # the whole completion's, in the final output
    delta_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    phase_times: dict[str, float] | None = None  # once finished: queue_s, prefill_s, transfer_s, decode_s
    # with SamplingParams.prompt_logprobs: one per prompt token (None for the first), in the first
    # output that carries a token (and, from `LLM.generate`, in the final one)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
