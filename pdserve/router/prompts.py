"""A request's prompt as token ids and its sampling settings, checked against the model the router
serves: the model's name, the context length, token ids within the vocabulary. Every refusal is
a 4xx naming the field, before anything is admitted."""

from __future__ import annotations

from pdserve.http_errors import APIError
from pdserve.router.config import RouterConfig
from pdserve.router.protocol import COMPLETIONS_REFUSE, NOT_SERVED, ChatCompletionRequest, CompletionRequest
from pdserve.router.tool_calls import HERMES, ToolCalls
from pdserve.sampling_params import Structure
from pdserve.structure import Grammars
from pdserve.tokenizer import Tokenizer
from pdserve.wire import Sampling


def prepare(req: CompletionRequest | ChatCompletionRequest, config: RouterConfig, tokenizer: Tokenizer,
            vocab_size: int, grammars: Grammars | None = None,
            calls: ToolCalls = ToolCalls(HERMES)) -> tuple[list[int], Sampling]:
    """(prompt token ids, sampling settings) of `req`; a chat goes through the model's template, and
    a tool call it forces is written as `calls` says."""
    if req.model != config.model_name:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                            f"{config.model_name!r}", "not_found_error", "model")
    refused = NOT_SERVED | (COMPLETIONS_REFUSE if isinstance(req, CompletionRequest) else {})
    for name, neutral in refused.items():
        value = getattr(req, name, None)
        if not any(value == v and type(value) is type(v) for v in neutral):
            raise APIError(400, f"{name} is not supported", param=name)
    if isinstance(req, ChatCompletionRequest):
        if not tokenizer.chat_template:  # a base model: it continues text, and has no turns to fill in
            raise APIError(400, f"the model {config.model_name!r} has no chat template, so it cannot take chat "
                                "messages; send the text as a prompt to /v1/completions instead", param="messages")
        try:
            messages = [m.for_template() for m in req.messages]
            tools = {"tools": [t.for_template() for t in req.tools]} if req.tools else {}
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **tools)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        max_tokens = req.max_completion_tokens or req.max_tokens
    else:
        if isinstance(req.prompt, str):
            ids = tokenizer.encode(req.prompt)
        else:
            ids = list(req.prompt)
            if any(not 0 <= t < vocab_size for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    for field, named in req.token_ids_named().items():
        if any(t >= vocab_size for t in named):
            raise APIError(400, f"{field} names token ids outside the vocabulary [0, {vocab_size})", param=field)
    limit = config.max_model_len
    if max_tokens is None:  # never the whole context by default: n of those would hold the pool for minutes
        max_tokens = max(1, min(config.max_tokens_default, limit - len(ids)))
    if max_tokens < 1 or len(ids) + max_tokens > limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has "
                            f"{len(ids)} and max_tokens asks for {max_tokens}", param="max_tokens")
    sampling = req.sampling(max_tokens, calls)
    if sampling.structure is not None and grammars is not None:  # built here too: refused before admission
        try:
            grammars.matcher(Structure(sampling.structure.kind, sampling.structure.spec))
        except ValueError as e:
            raise APIError(400, str(e), param=req.structure_field()) from None
    return ids, sampling
