"""What every soak action works with: the cluster under test (`Target`), the greedy answers it gave
when each request was sent alone (`Reference`), and one client's connections and seeded draws
(`SoakClient`)."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

import httpx

from pdserve.bench.soak.outcomes import Ledger

# Prompts of the valid traffic. The first few of each are sent alone before the soak, greedily,
# and their answers kept: greedy requests under load must give the same text.
COMPLETION_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
    "A list of fruits: apple, banana,",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Name three prime numbers.",
    "Why is the sky blue? One sentence.",
    "Say hello in Spanish.",
]
NUM_REFERENCES = 3  # of each kind
REFERENCE_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Reference:
    chat: bool
    prompt: str
    max_tokens: int
    text: str  # the greedy answer, sent alone
    finish_reason: str

    def expected(self, stop: str | None) -> tuple[str, str]:
        """(text, finish reason) a greedy request for this prompt must give, with `stop` if any."""
        if stop is not None and (at := self.text.find(stop)) >= 0:
            return self.text[:at], "stop"
        return self.text, self.finish_reason

    def stop_string(self, rng: random.Random) -> str | None:
        """A piece of the answer itself, so the stop string is sure to end it early."""
        if len(self.text) < 3:
            return None
        at = rng.randrange(1, len(self.text) - 1)
        piece = self.text[at:at + rng.randint(1, 4)]
        return piece if piece.strip() else None


@dataclass(slots=True)
class Target:
    url: str  # the router
    model: str  # the name it serves
    api_key: str
    max_model_len: int
    vocab_size: int
    timeout_s: float  # one request, end to end, before it counts as a hang
    stall_hold_s: float  # how long a reader that never reads holds its stream
    burst_size: int  # requests sent at once by the burst action
    burst_max_tokens: int  # output tokens each burst request asks for, read to the end
    burst_gap_s: float  # at least this long from one burst's start to the next's
    references: list[Reference] = field(default_factory=list)
    # one burst at a time, `burst_gap_s` apart: state the clients share, under the lock
    burst_lock: threading.Lock = field(default_factory=threading.Lock)
    burst_running: bool = False
    last_burst: float = float("-inf")  # monotonic start of the last burst
    first_burst_at: float = 0.0  # monotonic: none before, so the soak first meets an ordinary load

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


class SoakClient:
    """One soak client: its seeded draws and its kept-alive connections (not shared between
    threads). `openai` is built on first use (importing it takes a moment)."""

    def __init__(self, target: Target, ledger: Ledger, rng: random.Random) -> None:
        self.target, self.ledger, self.rng = target, ledger, rng
        self.http = httpx.Client(base_url=target.url, headers=target.auth, timeout=httpx.Timeout(target.timeout_s))
        self._openai = None

    @property
    def openai(self):
        if self._openai is None:
            import openai

            self._openai = openai.OpenAI(base_url=self.target.url + "/v1", api_key=self.target.api_key,
                                         max_retries=0, timeout=self.target.timeout_s)  # a retry would hide a 5xx
        return self._openai

    def close(self) -> None:
        self.http.close()
        if self._openai is not None:
            self._openai.close()


def build_references(target: Target) -> list[Reference]:
    """Each reference prompt sent alone, greedily: the answers greedy requests under load must match."""
    refs = []
    with httpx.Client(base_url=target.url, headers=target.auth, timeout=target.timeout_s) as http:
        for chat, prompts in ((False, COMPLETION_PROMPTS), (True, CHAT_PROMPTS)):
            for prompt in prompts[:NUM_REFERENCES]:
                body = {"model": target.model, "max_tokens": REFERENCE_MAX_TOKENS, "temperature": 0.0,
                        **prompt_fields(chat, prompt)}
                r = http.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"a reference request failed alone: HTTP {r.status_code}: {r.text[:300]}")
                choice = r.json()["choices"][0]
                text = choice["message"]["content"] if chat else choice["text"]
                refs.append(Reference(chat, prompt, REFERENCE_MAX_TOKENS, text, choice["finish_reason"]))
    return refs


def prompt_fields(chat: bool, prompt: str, parts: bool = False) -> dict:
    """The request fields carrying `prompt`; `parts`: chat content as a list of text parts (the same
    text, so the same answer)."""
    if not chat:
        return {"prompt": prompt}
    if parts:
        half = len(prompt) // 2
        content = [{"type": "text", "text": prompt[:half]}, {"type": "text", "text": prompt[half:]}]
        return {"messages": [{"role": "user", "content": content}]}
    return {"messages": [{"role": "user", "content": prompt}]}
