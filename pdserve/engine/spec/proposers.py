"""The proposer of each `--speculative` method (`engine/spec/__init__.py` says what a proposer is)."""

from __future__ import annotations

from pdserve.engine.spec.ngram import NgramProposer
from pdserve.engine.spec.suffix import SuffixProposer

SPECULATIVE_METHODS = ("off", "ngram", "suffix")


def make_proposer(method: str, num_tokens: int) -> NgramProposer | SuffixProposer | None:
    """The proposer of a `--speculative` method; None for off."""
    if method == "off":
        return None
    if method == "ngram":
        return NgramProposer(num_tokens)
    if method == "suffix":
        return SuffixProposer(num_tokens)
    raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
