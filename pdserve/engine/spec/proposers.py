"""The proposer of each `--speculative` method (`engine/spec/__init__.py` says what a proposer is)."""

from __future__ import annotations

from typing import Callable

from pdserve.engine.spec.draft import DraftModelProposer
from pdserve.engine.spec.head import HeadProposer
from pdserve.engine.spec.ngram import NgramProposer
from pdserve.engine.spec.suffix import SuffixProposer

DRAFT_PREFIX = "draft:"  # `--speculative draft:PATH`; the methods are checked by `EngineConfig`
HEAD_PREFIX = "head:"  # `--speculative head:PATH`: a draft head, which the engine's runner holds

Proposer = NgramProposer | SuffixProposer | DraftModelProposer | HeadProposer


def make_proposer(method: str, num_tokens: int,
                  load_draft: Callable[[str, int], DraftModelProposer] | None = None,
                  head_proposer: Callable[[int], HeadProposer] | None = None) -> Proposer | None:
    """The proposer of a `--speculative` method; None for off. `load_draft(path, num_tokens)` loads
    a draft model (the engine's, which knows the target it drafts for); `head_proposer(num_tokens)`
    drafts with the head the engine's runner loaded."""
    if method == "off":
        return None
    if method == "ngram":
        return NgramProposer(num_tokens)
    if method == "suffix":
        return SuffixProposer(num_tokens)
    if method.startswith(HEAD_PREFIX):
        if head_proposer is None:
            raise ValueError("a draft head needs the engine whose model it reads")
        return head_proposer(num_tokens)
    if not method.startswith(DRAFT_PREFIX):
        raise ValueError(f"speculative must be off, ngram, suffix, draft:PATH or head:PATH, got {method!r}")
    if load_draft is None:
        raise ValueError("a draft model needs the engine that serves its target")
    return load_draft(method[len(DRAFT_PREFIX):].strip(), num_tokens)
