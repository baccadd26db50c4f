"""One step's plan, as the scheduler hands it to the model runner (and to the role's hooks, which
see it before and after it runs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.request import Request


@dataclass(slots=True)
class SchedulerOutput:
    """What the model runner computes in one step."""

    requests: list[Request] = field(default_factory=list)  # decodes first, then prefill chunks
    num_new_tokens: list[int] = field(default_factory=list)  # tokens computed per request
    num_decodes: int = 0  # leading requests that compute exactly one token
    block_tables: list[list[int]] = field(default_factory=list)  # KV block ids per request
    preempted: list[Request] = field(default_factory=list)  # sent back to waiting this step

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def empty(self) -> bool:
        return not self.requests
