"""Every bound on what a request may carry, declared once, for the router, the workers and the
engine alike. Where a bound differs by who asks, each tier is here, narrowest first:

- a client of the OpenAI API (the router's edge: what the internet may send);
- a peer inside the cluster (the typed wire between router and workers, `wire.py`);
- the library (`LLM`, `LLMEngine`: code in the same process).

A value a client may send always passes the wire's bound, and the wire's the library's, so a
request the router admitted is never refused further in for its size.
"""

from __future__ import annotations

# -- completions and priorities, by tier ---------------------------------------------------------
MAX_CLIENT_N = 16  # completions per request from a client
MAX_N = 128  # completions per request on the wire and in the library
MAX_CLIENT_PRIORITY = 9  # clients may only lower their own priority: [0, 9], 0 (the default) first
MAX_WIRE_PRIORITY = 1000  # priorities from peers are in [-1000, 1000]
MAX_ABS_PRIORITY = 1 << 31  # the library's priorities are in [-2^31, 2^31]; lower goes first

# -- sampling (every tier) -----------------------------------------------------------------------
SEED_LIMIT = 1 << 63  # seeds are in [0, SEED_LIMIT); the n completions of one request use seed + i
MAX_TOKENS_LIMIT = 1 << 24  # max_tokens and min_tokens; the model's length is the real limit
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 20  # above any vocabulary; values at or past the vocabulary size cut nothing
MAX_CLIENT_STOP_STRINGS = 4  # stop strings per request from a client, as OpenAI allows
MAX_STOP_STRINGS = 16  # ... on the wire and in the library
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_ABS_PENALTY = 2.0  # presence_penalty and frequency_penalty are in [-2, 2], as OpenAI's
MAX_REPETITION_PENALTY = 10.0  # repetition_penalty is in (0, 10]; 1 changes nothing
MAX_LOGIT_BIAS_ENTRIES = 300  # token ids one logit_bias may name, as OpenAI allows
MAX_ABS_LOGIT_BIAS = 100.0  # each bias is in [-100, 100], as OpenAI's
MAX_LOGPROBS = 20  # most likely tokens reported with each token's log-probability, as OpenAI allows
MAX_STRUCTURE_CHARS = 64 << 10  # a structured output's JSON schema, regular expression or grammar, as text
MAX_SCHEMA_DEPTH = 32  # objects and arrays nested in a JSON schema
MAX_CHOICES = 256  # options of a `choice` structured output
MAX_CHOICE_CHARS = 1024  # ... each
MAX_TOOLS = 128  # tools a chat request offers, and calls one message holds
MAX_PROMPTS = 64  # prompts one completions request may carry

# -- sizes ---------------------------------------------------------------------------------------
TOKEN_ID_LIMIT = 1 << 31  # token ids are in [0, 2^31); the vocabulary is the real limit
MAX_SEQUENCE_TOKENS = 1 << 20  # prompt (or generated) token ids in one request; the model's length is lower
MAX_MESSAGES = 4096  # chat messages in one request, and content parts in one message
MAX_BLOCK_SIZE = 1024  # tokens per KV block a worker may announce
MAX_FENCE = (1 << 63) - 1  # KV lease fences

MAX_TENSOR_PARALLEL = 64  # ranks of one worker (`--tensor-parallel-size`), and of a peer's KV offer
