"""Incremental detokenization with stop strings.

Text is released only once it is final: never half of a multi-byte character (the decoder shows
an incomplete one as U+FFFD), and never the first characters of what might still become a stop
string. When a stop string appears, the text is cut exactly before it (or after it, if asked).
The prompt's last few tokens are decoded along for context (a leading space depends on it), up to
the end of its last whole character.
"""

from __future__ import annotations

from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Tokens decoded before the new ones, so the decoder sees their context (leading spaces, bytes).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stops = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stops), default=1) - 1
        self.token_ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # A prompt given as ids may stop inside a character. New bytes completing it would make the
        # text no longer than the context's, and never released: the context ends before it.
        while self.token_ids and tokenizer.decode(self.token_ids, self.skip_special).endswith(_REPLACEMENT):
            self.token_ids.pop()
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""  # all decoded text so far (before any stop cut)
        self.released = 0  # characters of `text` handed out so far
        self.stop_string: str | None = None

    def add(self, token_id: int) -> None:
        """Decodes one more token; sets `stop_string` when a stop string completed."""
        self.token_ids.append(token_id)
        prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset :], self.skip_special)
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return  # an incomplete character: wait for the bytes still to come
        new = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        before = len(self.text)
        self.text += new
        if self.stops:
            self._find_stop(before)

    def _find_stop(self, new_start: int) -> None:
        search_from = max(0, new_start - self.hold_back)
        best = None
        for stop in self.stops:
            i = self.text.find(stop, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is not None:
            i, stop = best
            self.text = self.text[: i + len(stop) if self.include_stop else i]
            self.stop_string = stop

    def flush(self) -> None:
        """At the end of a request: release what was held back as incomplete, as it decodes."""
        if self.stop_string is not None or self.read_offset == len(self.token_ids):
            return
        prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset :], self.skip_special)
        self.read_offset = len(self.token_ids)
        self.text += full[len(prefix) :]

    def take_delta(self, finished: bool) -> str:
        """Text not handed out before that is final now (all of it once the request finished)."""
        end = len(self.text)
        if not finished and self.stop_string is None:
            end -= self.hold_back
        if end <= self.released:
            return ""
        delta = self.text[self.released : end]
        self.released = end
        return delta
