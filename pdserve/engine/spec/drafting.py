"""What the scheduler asks of speculative decoding at the start of each step: drafts for the
running requests that decode one token, cut to the tokens expected to pay for their rows."""

from __future__ import annotations

from pdserve.engine.request import Request
from pdserve.engine.spec.budget import DraftBudget
from pdserve.engine.spec.verify import speculates


def propose_drafts(running: list[Request], proposer, budget: DraftBudget) -> None:
    """Set `draft` on the running requests that decode one token and may speculate: the
    proposer's tokens (`engine/spec/proposers.py`), as many as `budget` says pay
    (`engine/spec/budget.py`), and only what a request's structure allows."""
    wanted, rows = [], 0
    for req in running:
        if req.num_tokens - req.num_computed_tokens != 1:
            continue
        rows += 1
        if not speculates(req):
            continue
        if req.draft_pause:
            req.draft_pause -= 1
            continue
        wanted.append((req, req.max_total_tokens - req.num_tokens - 1))
    seconds = proposer.draft_seconds  # a token ahead, for all requests at once: 0 for a free proposer
    if wanted and seconds != 0:
        ahead = budget.lead(rows, len(wanted), seconds, proposer.num_tokens)
        wanted = [(req, min(limit, ahead)) for req, limit in wanted] if ahead else []
    drafting = []
    for (req, _), draft in zip(wanted, proposer.propose_all(wanted) if wanted else []):
        req.draft = draft
        if req.matcher is not None:  # only what its structure allows can be sampled
            req.draft = req.draft[: req.matcher.valid_prefix(req.draft)]
        if req.draft:
            drafting.append(req)
    # a request with no history yet, or back after drafts that missed, verifies a token anyway
    cut = budget.cut([(r.draft, r.acceptance, r.draft_misses > 0 or not r.acceptance.tried) for r in drafting], rows)
    for req, keep in zip(drafting, cut):
        req.draft = req.draft[:keep]
