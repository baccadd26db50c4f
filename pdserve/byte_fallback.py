"""Byte-fallback tokens (`<0xE4>`) decoded the way UTF-8 decoding does it, as llama.cpp and
sentencepiece do.

A sentencepiece vocabulary spells a character it has no token for as one token per UTF-8 byte.
`tokenizers`' ByteFallback decoder turns a run of such tokens into text only as a whole: one invalid
byte anywhere in the run makes every byte of it U+FFFD, the valid characters included (a stray
0xBD before the four bytes of 🫎 comes out as five replacement characters, where llama.cpp writes
"\ufffd🫎"). We decode each such run again with Python's UTF-8 decoder, which replaces only the
invalid sequences themselves.

Limits: the splice assumes the decoder gives a prefix of the tokens a prefix of the text (true of
the sentencepiece chain: Replace, ByteFallback, Fuse, Strip at the start); where the text does not
show the run where that puts it, tokenizers' text is kept as it is.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models

REPLACEMENT = "\ufffd"


class ByteFallback:
    def __init__(self, byte_of: dict[int, int]) -> None:
        self.byte_of = byte_of  # token id -> the byte it stands for

    @classmethod
    def of(cls, backend: _HFTokenizer) -> ByteFallback | None:
        """The byte tokens of `backend`, or None when its model does not fall back to bytes."""
        model = backend.model
        if not (isinstance(model, models.BPE) and model.byte_fallback):
            return None
        byte_of = {}
        for b in range(256):
            if (token_id := backend.token_to_id(f"<0x{b:02X}>")) is not None:
                byte_of[token_id] = b
        return cls(byte_of) if byte_of else None

    def fix(self, ids: list[int], text: str, decode: Callable[[list[int]], str], skipped: set[int]) -> str:
        """`text`, tokenizers' decoding of `ids`, with each invalid run of byte tokens decoded as
        UTF-8 decoding replaces it. `decode` decodes ids without skipping any; `skipped` are the ids
        the caller's decoding left out (special tokens), so runs join across them as they did there."""
        if REPLACEMENT not in text:  # every run was valid UTF-8 (or had no byte tokens)
            return text
        kept = [i for i in ids if i not in skipped] if skipped else ids
        for start, end, good in reversed(self._invalid_runs(kept)):  # from the end: earlier offsets hold
            at = len(decode(kept[:start]))
            if text[at : at + end - start] != REPLACEMENT * (end - start):
                return text
            text = text[:at] + good + text[at + end - start :]
        return text

    def _invalid_runs(self, ids: list[int]) -> list[tuple[int, int, str]]:
        """(start, end, text) of each maximal run of byte tokens that is not valid UTF-8."""
        runs = []
        start = None
        for i, token_id in enumerate([*ids, -1]):  # -1: a sentinel that ends the last run
            if token_id in self.byte_of:
                start = i if start is None else start
                continue
            if start is not None:
                raw = bytes(self.byte_of[t] for t in ids[start:i])
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError:
                    runs.append((start, i, raw.decode("utf-8", "replace")))
                start = None
        return runs
