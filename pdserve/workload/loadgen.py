"""What `pdserve bench` sends and when: seeded prompts and output lengths, and arrival times.

- Lengths: `N` (fixed), `A-B` (uniform, inclusive), `M+-S` or `M±S` (normal, clipped at 1).
- Prompts: random token ids (exact input lengths on any tokenizer), optionally behind one of a
  few shared prefixes (a shared system prompt), or sessions of several turns where each turn's
  prompt extends the last one (after a think time: the KV of a session's prefix may have left a
  worker's pool by its next turn); or the prompts of a JSONL dataset (`{"prompt": ...}` per line,
  optionally `"max_tokens"`).
- Arrivals: a Poisson process at a request rate, or gamma with a burstiness (shape: 1 is Poisson,
  below 1 burstier), or all at once (`inf`); `--concurrency` caps requests in flight.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path

_NORMAL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:\+-|±)\s*(\d+(?:\.\d+)?)\s*$")
_UNIFORM = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


@dataclass(frozen=True, slots=True)
class LengthDist:
    kind: str  # fixed | uniform | normal
    a: float  # the value, the lower bound, or the mean
    b: float = 0.0  # -, the upper bound, or the standard deviation

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        text = str(text)
        if m := _NORMAL.match(text):
            return cls("normal", float(m[1]), float(m[2]))
        if m := _UNIFORM.match(text):
            lo, hi = int(m[1]), int(m[2])
            if lo > hi or lo < 1:
                raise ValueError(f"a uniform length needs 1 <= A <= B, got {text!r}")
            return cls("uniform", lo, hi)
        if text.strip().isdigit() and int(text) >= 1:
            return cls("fixed", int(text))
        raise ValueError(f"a length is N, A-B (uniform) or M+-S (normal); got {text!r}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))

    @property
    def mean(self) -> float:
        return (self.a + self.b) / 2 if self.kind == "uniform" else self.a

    def __str__(self) -> str:
        return {"fixed": f"{self.a:g}", "uniform": f"{self.a:g}-{self.b:g}", "normal": f"{self.a:g}+-{self.b:g}"}[self.kind]


@dataclass(slots=True)
class BenchRequest:
    prompt: list[int] | str
    max_tokens: int
    session: int = -1  # requests of one multi-turn session go one after another
    turn: int = 0
    think_s: float = 0.0  # a later turn: seconds the user takes after the previous turn's answer

    @property
    def prompt_tokens(self) -> int:  # exact for token ids; a rough count for text
        return len(self.prompt) if isinstance(self.prompt, list) else max(1, len(self.prompt) // 4)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    num_requests: int
    input_len: LengthDist
    output_len: LengthDist
    seed: int = 0
    vocab_size: int = 256
    shared_prefix_len: int = 0  # tokens of a shared system prompt before every prompt
    num_prefixes: int = 1  # distinct shared prefixes, chosen at random per request
    turns: int = 1  # > 1: sessions of this many turns, each extending the last
    dataset: str | None = None
    think_time: float = 0.0  # seconds between a turn's answer and the session's next turn

    def describe(self) -> dict:
        return {"num_requests": self.num_requests, "input_len": str(self.input_len), "output_len": str(self.output_len),
                "seed": self.seed, "shared_prefix_len": self.shared_prefix_len, "num_prefixes": self.num_prefixes,
                "turns": self.turns, "think_time": self.think_time, "dataset": self.dataset}


def build_requests(spec: WorkloadSpec) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    if spec.dataset:
        return _from_dataset(spec, rng)
    low = min(10, spec.vocab_size - 1)  # leave the first ids (often special tokens) alone

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low, spec.vocab_size) for _ in range(n)]

    prefixes = [tokens(spec.shared_prefix_len) for _ in range(max(1, spec.num_prefixes))]
    out: list[BenchRequest] = []
    session = 0
    while len(out) < spec.num_requests:
        context = list(rng.choice(prefixes))
        for turn in range(max(1, spec.turns)):
            if len(out) == spec.num_requests:
                break
            context = context + tokens(spec.input_len.sample(rng))
            max_tokens = spec.output_len.sample(rng)
            out.append(BenchRequest(list(context), max_tokens, session if spec.turns > 1 else -1, turn,
                                    spec.think_time if turn else 0.0))
            context += tokens(max_tokens)  # a stand-in for the reply the next turn carries
        session += 1
    return out


def _from_dataset(spec: WorkloadSpec, rng: random.Random) -> list[BenchRequest]:
    rows = []
    for i, line in enumerate(Path(spec.dataset).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{spec.dataset}:{i + 1}: each line must be a JSON object with a \"prompt\"") from None
        if not isinstance(prompt, (str, list)) or not prompt:
            raise ValueError(f"{spec.dataset}:{i + 1}: \"prompt\" must be a non-empty string or list of token ids")
        rows.append((prompt, int(row.get("max_tokens") or spec.output_len.sample(rng))))
    if not rows:
        raise ValueError(f"{spec.dataset} holds no prompts")
    return [BenchRequest(*rows[i % len(rows)]) for i in range(spec.num_requests)]


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets in seconds for `n` requests: gamma-distributed gaps with mean 1/rate and shape
    `burstiness` (1: a Poisson process); all zero for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("the request rate and the burstiness must be positive")
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out
