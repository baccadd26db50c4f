"""Structured outputs: a request's tokens are masked, at every step, to those that keep its output
inside its structure (a JSON schema, a regular expression, a choice of strings, a Lark grammar),
by llguidance's matcher (chosen by measurement on a 2-vCPU Xeon with the default model's 49,152
tokens: ~8 us a token for mask and advance, under a millisecond to compile a schema, no
dependency; xgrammar needs torch, transformers and triton, outlines-core took 5.9 s to compile
JSON-object mode).

A matcher is built from the request's structure and every token so far, so the worker that
samples a token masks it as any other would: the prefill worker its first token, the decode
worker the rest (it checks the first token against the structure when it lands), and a worker a
request moved or migrated to. llguidance bounds its own work on any grammar (`LLParserLimits`):
a pathological structure is refused when it is built, or ends its own request, never stalls a step.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.sampling_params import Structure
from pdserve.structure import Grammars
from pdserve.tokenizer import Tokenizer


class Matcher:
    """One request's place in its structure."""

    __slots__ = ("_m", "eos_token_ids")

    def __init__(self, m, eos_token_ids: tuple[int, ...]) -> None:
        self._m, self.eos_token_ids = m, eos_token_ids

    def allows(self, token: int) -> bool:
        return self._m.validate_tokens([token]) == 1

    def consume(self, token: int) -> bool:
        """Advance past `token`; False if the structure does not allow it."""
        return self._m.consume_token(token)

    @property
    def done(self) -> bool:
        """The structure is complete and ended (or the matcher failed): nothing more may follow."""
        return self._m.is_stopped() or self._m.is_error()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the first, the structure allows to follow in turn."""
        return self._m.validate_tokens(tokens)

    def fill(self, row: np.ndarray, ahead: list[int] = ()) -> None:
        """The allowed tokens' bits after the tokens so far and then `ahead` (a valid prefix:
        drafts being verified), which the matcher takes and gives back."""
        if ahead and not self._m.consume_tokens(ahead):
            raise ValueError("tokens ahead that the structure does not allow")
        try:
            self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        finally:
            if ahead:
                self._m.rollback(len(ahead))


def mask_logits(logits: torch.Tensor, matchers: list[tuple[Matcher, list[int]] | None]) -> torch.Tensor:
    """`logits` ([rows, vocab]) with each structured row's disallowed tokens at -inf (a copy; the
    other rows as they were). A structured row names its matcher and the tokens ahead of the row
    (drafts being verified: usually none); a row whose matcher allows nothing (it failed) may only end."""
    vocab = logits.shape[1]
    rows = [i for i, m in enumerate(matchers) if m is not None]
    bits = np.empty((len(rows), (vocab + 31) // 32), dtype=np.int32)
    for j, i in enumerate(rows):
        matcher, ahead = matchers[i]
        matcher.fill(bits[j], ahead)
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    for j in np.flatnonzero(~allowed.any(axis=1)):
        allowed[j, list(matchers[rows[j]][0].eos_token_ids)] = True
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(torch.from_numpy(~allowed).to(logits.device), float("-inf"))
    return out


class Structures:
    """One engine's structured outputs: the matchers it builds, at the state the tokens so far
    leave them in."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.grammars = Grammars(tokenizer, vocab_size, eos_token_ids)

    def matcher(self, structure: Structure, tokens_so_far: list[int]) -> Matcher:
        """ValueError (naming the structure) for one that cannot be built, or tokens it does not allow."""
        m = self.grammars.matcher(structure)
        if tokens_so_far and not m.consume_tokens(tokens_so_far):
            raise ValueError(f"the tokens so far do not match the {structure.kind} structure")
        return Matcher(m, self.grammars.eos_token_ids)
