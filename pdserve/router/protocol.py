"""OpenAI request and response shapes (the subset pdserve serves), and its error shape."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt

from pdserve.sampling_params import MAX_TOKENS_LIMIT, MAX_TOP_K, SEED_LIMIT


MAX_N = 16
MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_STOP_CHARS = 256
MAX_CLIENT_PRIORITY = 9  # clients may only lower their own priority: 0 (the default) goes first
MAX_PROMPT_TOKEN_IDS = 1 << 20
MAX_MESSAGES = 4096



def _encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: valid JSON ("\ud800"), but no tokenizer can take it
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(_encodable)]
Finite = Annotated[float, Field(allow_inf_nan=False)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields other clients send that change nothing here
    model: str = Field(max_length=256)
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: Finite = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Finite = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=-1, ge=-1, le=MAX_TOP_K)
    min_p: Finite = Field(default=0.0, ge=0.0, le=1.0)
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    seed: StrictInt | None = Field(default=None, ge=0, lt=SEED_LIMIT)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: StrictInt = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT)
    priority: StrictInt = Field(default=0, ge=0, le=MAX_CLIENT_PRIORITY)
    logprobs: bool | StrictInt | None = None  # not served: refused unless absent, false or 0

    def sampling(self, max_tokens: int) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {"n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "min_p": self.min_p, "seed": self.seed, "max_tokens": max_tokens, "stop": stop,
                "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens}


class CompletionRequest(_Sampling):
    prompt: Text | Annotated[list[Annotated[StrictInt, Field(ge=0, lt=1 << 31)]],
                             Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]
    echo: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text ones are served here
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)


# -- what workers send the router (token holders, bounded all the same) ---------------------------

StatValue = StrictInt | float | Annotated[str, Field(max_length=256)] | bool | None
Count = Annotated[StrictInt, Field(ge=0, le=1 << 40)]


def _power_of_two(n: int) -> int:
    if n & (n - 1):
        raise ValueError(f"block_size must be a power of two, got {n}")
    return n


class RegisterBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str = Field(max_length=512, pattern=r"^https?://[^\s/?#]{1,255}/?$")
    role: Literal["prefill", "decode", "both"]
    model_hash: str = Field(max_length=128)
    # tokens per KV block of its engine: the router hashes prompts in blocks of this size to know
    # which prefixes the worker's cache holds
    block_size: Annotated[StrictInt, Field(ge=1, le=1024), AfterValidator(_power_of_two)] = 16


class LoadReport(BaseModel):
    """The fields of a heartbeat the router reads (routing policies, metrics): counts, and a finite
    latency. The rest of a heartbeat's stats is kept as sent, for display only."""
    model_config = ConfigDict(extra="ignore")
    running: Count = 0
    waiting: Count = 0
    waiting_for_kv: Count = 0
    queued_prefill_tokens: Count = 0
    kv_blocks_used: Count = 0
    kv_blocks_total: Annotated[StrictInt, Field(ge=1, le=1 << 40)] = 1
    step_latency_ewma_ms: Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)] = 0.0
    kv_bytes_received: Annotated[StrictInt, Field(ge=0, le=1 << 62)] = 0  # summed over workers in /metrics
    capacity: Count = 0  # sequences the worker holds at most, running and queued (0: not said)


class HeartbeatBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    worker_id: str = Field(max_length=64)
    stats: Annotated[dict[Annotated[str, Field(max_length=64)], StatValue], Field(max_length=128)] = Field(
        default_factory=dict)

    def load(self) -> LoadReport:
        return LoadReport.model_validate(self.stats)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def now() -> int:
    return int(time.time())
