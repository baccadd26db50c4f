"""Why each failed request of a chaos run failed, from what its client saw and when the faults went
in. Three causes, each of its own remedy:

- refused: no router took the request (the connection failed: nothing listened; or 429/503: no
  room, or no worker yet). A client may retry it at once; replicas on one address make it rare.
- in flight: it was running when a fault was injected (its start before the fault, its end after):
  it was on the process hit, or waiting on it. Counted by the fault's kind. Only the requests on
  a killed router, whose stream dies with it, are beyond a cluster's power to save.
- later: it failed with no fault injected while it ran: begun after the fault, it failed all the
  same. A cluster that recovers whole shows none.
"""

from __future__ import annotations

from collections import Counter

from pdserve.bench.chaos.faults import Injection
from pdserve.bench.chaos.load import RequestResult

CAUSES = ("refused", "in_flight", "later")


def cause(result: RequestResult, injections: list[Injection]) -> tuple[str, str | None]:
    """(cause, the kind of the fault it was in flight at, if that is the cause) of an error."""
    if result.refused:
        return "refused", None
    end = result.end if result.end is not None else float("inf")
    hit = [i for i in injections if result.start <= i.at <= end]
    if hit:
        return "in_flight", hit[-1].fault.kind
    return "later", None


def errors_by_cause(results: list[RequestResult], injections: list[Injection]) -> dict:
    """{"refused": n, "in_flight": n, "later": n, "in_flight_by_fault": {kind: n}, "later_details": {detail: n}}"""
    counts, by_fault, later = Counter(), Counter(), Counter()
    for r in results:
        if r.outcome != "error":
            continue
        why, kind = cause(r, injections)
        counts[why] += 1
        if kind is not None:
            by_fault[kind] += 1
        if why == "later":
            later[r.detail] += 1
    return {**{c: counts[c] for c in CAUSES}, "in_flight_by_fault": dict(by_fault), "later_details": dict(later)}
