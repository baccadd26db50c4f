"""Where the time to recover from each fault went, read after the run from what was recorded: the
supervisor's events, the watcher's samples (every half second: a mark read from them is late by
up to that much) and the requests' results. Pure functions of those records, so tested on made-up
timelines.

The marks of each kind of fault, in seconds after it went in (a mark not seen is left out):
- kill-worker: exit seen (the launcher's exit event), dropped by the router (its old URL gone
  from /admin/workers), restarted (after the backoff), process started (the interpreter up and
  its imports done: `ready_again`'s time less its load_seconds), model loaded (`ready_again`),
  registered (its new URL serving in /admin/workers), serving (its first engine step).
- drain: left the router (draining or gone in /admin/workers), exited (drained, exit code
  recorded), then restarted, process started, model loaded, registered, serving as above.
- kill-router: exit seen, restarted, listening (`ready_again`), workers registered (every worker
  back in /admin/workers), first request served (the first request sent after the router was
  ready that ended well).
- freeze-worker: resumed (SIGCONT), dropped by the router (if its lease lapsed meanwhile),
  heartbeat again (registered with a heartbeat under 1.5 s old), serving (its engine stepped
  again).
- cut-kv: KV landed again (a decode worker's count of landed transfers went up), first request
  served.
"""

from __future__ import annotations

from pdserve.bench.chaos.faults import Injection
from pdserve.bench.chaos.load import RequestResult

FRESH_HEARTBEAT_S = 1.5


def first(samples: list[dict], after: float, test) -> float | None:
    return next((s["at"] for s in samples if s["at"] > after and test(s)), None)


def event_at(events: list[dict], kind: str, name: str, after: float) -> dict | None:
    return next((e for e in events if e["event"] == kind and e.get("name") == name and e["at"] > after), None)


def first_served(results: list[RequestResult], after: float) -> float | None:
    """The end of the first request sent after `after` that ended well."""
    return min((r.end for r in results if r.outcome == "ok" and r.start > after), default=None)


def _last_before(samples: list[dict], before: float) -> dict | None:
    prior = [s for s in samples if s["at"] <= before]
    return prior[-1] if prior else None


def recovery_marks(injection: Injection, events: list[dict], samples: list[dict], results: list[RequestResult],
                   workers: int) -> dict[str, float]:
    """{mark: absolute monotonic time} of one fault, in the order they are expected."""
    fault, at, old_url = injection.fault, injection.at, injection.url
    marks: dict[str, float | None] = {}
    exited = event_at(events, "exited", fault.target, at)
    restarted = event_at(events, "restarted", fault.target, at)
    ready = event_at(events, "ready_again", fault.target, at)
    new_url = ready.get("url") if ready else None
    if fault.kind in ("kill-worker", "drain"):
        if fault.kind == "kill-worker":
            marks["exit seen"] = exited and exited["at"]
            marks["dropped by the router"] = first(samples, at, lambda s: s["router_up"] and old_url not in s["registered"])
        else:
            marks["left the router"] = first(samples, at, lambda s: s["router_up"] and (
                s["registered"].get(old_url, {}).get("state", "gone") != "serving"))
            marks["exited"] = exited and exited["at"]
        marks["restarted"] = restarted and restarted["at"]
        marks["process started"] = ready and ready.get("load_seconds") is not None and (
            ready["at"] - ready["load_seconds"])
        marks["model loaded"] = ready and ready["at"]
        if new_url:
            marks["registered"] = first(samples, at, lambda s: s["registered"].get(new_url, {}).get("state") == "serving")
            marks["serving"] = first(samples, at, lambda s: s["stats"].get(new_url, {}).get("num_steps", 0) > 0)
    elif fault.kind == "kill-router":
        marks["exit seen"] = exited and exited["at"]
        marks["restarted"] = restarted and restarted["at"]
        marks["listening"] = ready and ready["at"]
        since = ready["at"] if ready else at
        marks["workers registered"] = first(samples, since, lambda s: sum(
            w["state"] == "serving" for w in s["registered"].values()) >= workers)
        marks["first request served"] = first_served(results, since)
    elif fault.kind == "freeze-worker":
        resumed = injection.resumed_at or at
        marks["resumed"] = resumed
        marks["dropped by the router"] = first(samples, at, lambda s: s["router_up"] and old_url not in s["registered"]
                                               and s["at"] <= resumed + FRESH_HEARTBEAT_S)
        marks["heartbeat again"] = first(samples, resumed, lambda s: s["registered"].get(old_url, {}).get(
            "heartbeat_age_s", 1e9) < FRESH_HEARTBEAT_S)
        before = _last_before(samples, at)
        steps = (before or {}).get("stats", {}).get(old_url, {}).get("num_steps", 0)
        marks["serving"] = first(samples, resumed, lambda s: s["stats"].get(old_url, {}).get("num_steps", 0) > steps)
    elif fault.kind == "cut-kv":
        before = _last_before(samples, at)
        landed = sum(w.get("kv_landed", 0) for w in (before or {}).get("stats", {}).values())
        marks["KV landed again"] = first(samples, at, lambda s: sum(
            w.get("kv_landed", 0) for w in s["stats"].values()) > landed)
        marks["first request served"] = first_served(results, at)
    return {k: v for k, v in marks.items() if v is not None}


def breakdown(injection: Injection, events: list[dict], samples: list[dict], results: list[RequestResult],
              workers: int) -> dict:
    """One fault's recovery: every mark in seconds after the fault, the step to each mark from the
    one before it in the expected order (0 where sampling saw them the other way round), the total (to the last mark, or to the time the cluster was seen whole, whichever is
    later), and the requests that ended badly while it lasted."""
    at = injection.at
    marks = recovery_marks(injection, events, samples, results, workers)
    ordered = list(marks.items())  # in the expected order: a step is the time that mark took
    steps, previous = {}, at
    for name, t in ordered:
        steps[name] = round(max(0.0, t - previous), 3)
        previous = max(previous, t)
    ends = [t for t in (*marks.values(), injection.recovered_at) if t is not None]
    until = max(ends) if ends else None
    window = [r for r in results if r.end is not None and r.end >= at and (until is None or r.start <= until)]
    exited = event_at(events, "exited", injection.fault.target, at)
    return {"marks_s": {name: round(t - at, 3) for name, t in ordered}, "steps_s": steps,
            "total_s": None if until is None else round(until - at, 3),
            "recovered": injection.recovered_at is not None, "exit_code": exited["code"] if exited else None,
            "requests_meanwhile": {o: sum(r.outcome == o for r in window) for o in ("ok", "error", "lost")}}


def unexpected_exits(events: list[dict], injections: list[Injection], after: float) -> list[dict]:
    """Exits of processes no fault hit since `after` (a process that exited because a peer did);
    one exit per fault on its target is expected (none for a freeze or a KV cut)."""
    expected: dict[str, int] = {}
    for inj in injections:
        if inj.fault.kind in ("kill-worker", "kill-router", "drain"):
            expected[inj.fault.target] = expected.get(inj.fault.target, 0) + 1
    out = []
    for e in events:
        if e["event"] != "exited" or e["at"] <= after:
            continue
        if expected.get(e["name"], 0) > 0:
            expected[e["name"]] -= 1
        else:
            out.append({"name": e["name"], "code": e.get("code")})
    return out
