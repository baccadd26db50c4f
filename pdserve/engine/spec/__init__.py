"""Speculative decoding: a request's next tokens proposed cheaply, then verified in one step.

1. Before a step, the scheduler asks the proposer for up to `num_tokens` drafts for each running
   request that decodes one token and may speculate (`speculates`), and schedules it as a chunk of
   its last token and the drafts (`Request.draft`): KV slots for all of them are allocated.
2. The step computes the chunk like decode rows over the cache and samples a token after each of
   its positions, as decoding one at a time would have: the drafts ahead of a position count as
   output so far (penalties), the structure's mask is taken after them, and a seeded request's
   position j draws the generator's j-th next noise row (the sampler's exponential race).
3. The scheduler keeps the drafts up to the first the model did not sample, and the model's own
   token there (`verified`): between one and `len(draft) + 1` new tokens. Only the KV of the last
   token and the kept drafts counts as computed; a rejected draft's slots are written again by
   the next step, and no block holding one is ever cached, as the prefix cache takes full blocks
   of computed tokens only.

Why this keeps the target distribution: a draft here is one token, not a distribution (the
proposer is deterministic), and the standard accept/resample rule for such a draft (accept with
probability p(draft), else sample from p without the draft, renormalized) gives exactly the
token p's own draw gives: the draw equals the draft with probability p(draft), and otherwise it
is a draw from p given that it is not the draft. With the same noise the draw is also the very
token decoding without speculation samples, so a seeded request's output does not depend on
speculation at all (greedy is the case of no noise); its generator is then set back to where
drawing only the kept positions leaves it.

The modules: `ngram` (prompt lookup: where the output repeats its input, the tokens that followed
the latest earlier occurrence of the last few tokens are likely to follow again), `suffix` (also
what recent requests on the worker wrote), `draft` (a draft model with the target's tokenizer,
run a few tokens ahead over a KV cache of its own), `head` (a draft head on the model's own
hidden states, which the runner hands it every step), `proposers` (the proposer of each
`--speculative` method), `budget` (how many draft tokens each request verifies at a step),
`verify` (who drafts, and what a verified draft gives). A proposer has `num_tokens`, `method`,
`propose_all([(request, limit)])` (the drafts of each), `release(request)` (the request left the
running set: finished, aborted, moved or preempted), `finished(request)` (a request that ended
here; what it wrote may teach the proposer) and `forget()`. A structured request's draft is cut to the tokens its structure allows; a request may
opt out (`SamplingParams.speculate`).
"""
