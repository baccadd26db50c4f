"""Which requests draft, and what a verified draft gives (the rule: `engine/spec/__init__.py`)."""

from __future__ import annotations

from pdserve.engine.request import Request


def speculates(request: Request) -> bool:
    """Whether the request's next tokens may be drafted: it decodes here and did not opt out."""
    return request.params.speculate and not request.remote_prefill


def verified(draft: list[int], sampled: list[int]) -> list[int]:
    """The new tokens a verified draft gives: the drafts the model sampled, then the model's own
    token after them (`sampled[i]` is its token after the last token and the first i drafts)."""
    a = 0
    while a < len(draft) and draft[a] == sampled[a]:
        a += 1
    return draft[:a] + [sampled[a]]

