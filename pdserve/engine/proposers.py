"""The proposer of each `--speculative` method (`speculative.py` says what a proposer is)."""

from __future__ import annotations

from pdserve.engine.speculative import SPECULATIVE_METHODS, NgramProposer
from pdserve.engine.suffix_proposer import SuffixProposer


def make_proposer(method: str, num_tokens: int) -> NgramProposer | SuffixProposer | None:
    """The proposer of a `--speculative` method; None for off."""
    if method == "off":
        return None
    if method == "ngram":
        return NgramProposer(num_tokens)
    if method == "suffix":
        return SuffixProposer(num_tokens)
    raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
