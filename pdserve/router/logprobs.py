"""Log-probabilities in OpenAI's two shapes, from the per-token entries workers send
(`wire.TokenLogprob`: token id, log-probability, most likely tokens'). A token's text is its own
decoding (a byte-level token that is part of a character reads as the replacement character, as
in vLLM); `bytes` are that text's UTF-8.

- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`
- completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`,
  each list one item per token; a token's text offset counts from the completion's start.
"""

from __future__ import annotations

from pdserve.tokenizer import Tokenizer
from pdserve.wire import TokenLogprob


class LogprobsFormat:
    """One request's log-probabilities as its responses show them; `offsets` keeps each
    completion's running text offset across the chunks of a stream."""

    def __init__(self, tokenizer: Tokenizer, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.offsets: dict[int, int] = {}
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def shape(self, index: int, entries: list[TokenLogprob]) -> dict:
        """The `logprobs` of completion `index` for these tokens (a chunk's, or the whole answer's)."""
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries], "refusal": None}
        return self._completions(index, [e.token_id for e in entries], entries)

    def prompt(self, index: int, prompt_ids: list[int], entries: list[TokenLogprob | None] | None) -> dict:
        """Completion `index`'s `logprobs` for its echoed prompt (completions' shape): the first
        token has none, having nothing before it."""
        return self._completions(index, prompt_ids, entries or [None] * len(prompt_ids))

    def _completions(self, index: int, token_ids: list[int], entries: list[TokenLogprob | None]) -> dict:
        tokens = [self.text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(self.offsets.get(index, 0))
            self.offsets[index] = offsets[-1] + len(token)
        # the chosen token last: where two tokens read alike, its own value is the one shown
        top = [{self.text(t): lp for t, lp in [*e.top, (e.token_id, e.logprob)]} if e else None for e in entries]
        return {"tokens": tokens, "token_logprobs": [e.logprob if e else None for e in entries],
                "top_logprobs": top, "text_offset": offsets}

    def _chat_entry(self, e: TokenLogprob) -> dict:
        return {**self._token(e.token_id, e.logprob), "top_logprobs": [self._token(t, lp) for t, lp in e.top]}

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def joined(parts: list[dict]) -> dict:
    """Several chunks' `logprobs` as one (the non-streamed answer)."""
    merged: dict = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, list):
                merged.setdefault(key, []).extend(value)
            else:
                merged[key] = value
    return merged
