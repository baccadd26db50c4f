"""Per-request sampling settings, validated on construction (same names as vLLM's).

Every field has a documented bound, checked here for the library and the worker's control API
alike, so that no value one request carries can fail the batch it runs in (a top_k too large for a
tensor, a seed the generator cannot take, a stop "string" that is a number).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.limits import (
    MAX_ABS_LOGIT_BIAS, MAX_ABS_PENALTY, MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS, MAX_N, MAX_STRUCTURE_CHARS, MAX_REPETITION_PENALTY, MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE, MAX_TOKENS_LIMIT, MAX_TOP_K, SEED_LIMIT,
)

_GREEDY_EPS = 1e-5


STRUCTURE_KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class Structure:
    """Output that must match a structure: `json` (a JSON schema, as text), `regex`, `choice` (a
    JSON list of strings: one of them, exactly) or `grammar` (Lark syntax). Checked against its
    bounds here, and compiled by the worker that samples (`engine/structured.py`)."""

    kind: str
    spec: str

    def __post_init__(self) -> None:
        _check(self.kind in STRUCTURE_KINDS, f"a structure is one of {', '.join(STRUCTURE_KINDS)}, got {self.kind!r}")
        _check(isinstance(self.spec, str) and 0 < len(self.spec) <= MAX_STRUCTURE_CHARS,
               f"a {self.kind} structure is 1 to {MAX_STRUCTURE_CHARS} characters")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's max length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # penalties and biases on the logits before sampling (`layers/penalties.py`), greedy rows too
    presence_penalty: float = 0.0  # less this once a token is in the output
    frequency_penalty: float = 0.0  # less this times the token's count in the output
    repetition_penalty: float = 1.0  # a token in the prompt or output: its logit / this (x this if negative)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # each sampled token's log-probability and this many most likely tokens' (None: none), from the
    # model's distribution as it is, before penalties and sampling settings
    logprobs: int | None = None
    # each prompt token's log-probability given the tokens before it (the first has none) and this
    # many most likely tokens' there; such a prompt is computed whole, never taken from the cache
    prompt_logprobs: int | None = None
    structure: Structure | None = None  # the output matches it (masked at every token, the first too)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (workers: the router makes the text)
    # False: never drafted, where the engine speculates (the output is the same either way; a
    # client may still want each step's cost to be the plain one)
    speculate: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.stop is None or isinstance(self.stop, (list, tuple)), "stop must be a string or a list of strings")
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)),
               "stop_token_ids must be a list of integers")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check_int("n", self.n, 1, MAX_N)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and -1 <= self.top_k <= MAX_TOP_K,
               f"top_k must be -1 (disable) or in [0, {MAX_TOP_K}], got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, SEED_LIMIT - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT)
        _check_int("min_tokens", self.min_tokens, 0, MAX_TOKENS_LIMIT)
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        _check(len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        _check(all(isinstance(s, str) for s in self.stop), "stop must be a string or a list of strings")
        _check(all(s for s in self.stop), "stop strings must not be empty")
        _check(all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
               f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
               f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers")
        _check_float("presence_penalty", self.presence_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
        _check_float("frequency_penalty", self.frequency_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
        _check(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
               f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}")
        _check(isinstance(self.logit_bias, dict), "logit_bias must map token ids to numbers")
        self.logit_bias = dict(self.logit_bias)
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES,
               f"logit_bias names at most {MAX_LOGIT_BIAS_ENTRIES} token ids, got {len(self.logit_bias)}")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.logit_bias),
               "logit_bias keys must be non-negative token ids")
        for value in self.logit_bias.values():
            _check_float("a logit_bias value", value, -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        _check(self.structure is None or isinstance(self.structure, Structure), "structure must be a Structure")
        for name, flag in (("ignore_eos", self.ignore_eos), ("skip_special_tokens", self.skip_special_tokens),
                           ("include_stop_str_in_output", self.include_stop_str_in_output),
                           ("detokenize", self.detokenize), ("speculate", self.speculate)):
            _check(isinstance(flag, bool), f"{name} must be true or false")
        _check(self.detokenize or not self.stop, "stop strings need detokenize=True: they are found in the text")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def penalized(self) -> bool:
        """Some penalty or bias changes the logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    def clone(self, **changes: object) -> SamplingParams:
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values.update(changes)
        values["stop"] = list(values["stop"])
        values["stop_token_ids"] = list(values["stop_token_ids"])
        values["logit_bias"] = dict(values["logit_bias"])
        return SamplingParams(**values)

    def child_seed(self, index: int) -> int | None:
        """The seed of completion `index` of n: consecutive seeds, wrapping within the range."""
        return None if self.seed is None else (self.seed + index) % SEED_LIMIT


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
    _check(ok, f"{name} must be an integer in [{lo}, {hi}], got {value!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_float(name: str, value: object, lo: float, hi: float) -> None:
    _check(_is_number(value) and lo <= value <= hi, f"{name} must be a number in [{lo:g}, {hi:g}], got {value!r}")
