"""What the soak counts: each request's outcome, judged against what its action accepts.

- `Expect`: the answers an action accepts. 429 and 503 count only with a Retry-After header,
  errors only in the OpenAI shape (`{"error": {"message": ..., "type": ...}}`), and a closed
  connection only for connection-level abuse (a slow head, a stalled body).
- `classify_response` / `classify_exception`: one `Outcome` per request; `failure` says why it is
  not acceptable (None when it is).
- `Ledger`: every request is opened before its first byte is sent and closed with its outcome, so
  a request nobody judged shows up as unaccounted instead of vanishing from the counts.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

RETRY_LATER = frozenset({429, 503})  # refusals that must say when to come back
MAX_SAMPLES_PER_KIND = 3  # failure samples kept per (action, outcome)
SAMPLE_CHARS = 600  # of a body kept in a sample


@dataclass(frozen=True, slots=True)
class Expect:
    statuses: frozenset[int]  # HTTP statuses that are a right answer here
    closed_ok: bool = False  # connection-level abuse: the server closing the connection is an answer too

    @classmethod
    def of(cls, *statuses: int, closed_ok: bool = False) -> Expect:
        return cls(frozenset(statuses), closed_ok)


# A valid request: an answer, or the router's bounded queue refusing it. A 503 is a server error
# here like any 5xx: a soak's load stays within the router's connection limit.
SERVED = Expect.of(200, 429)


@dataclass(slots=True)
class Outcome:
    label: str  # the table's column: "200", "400", "429", "closed", "abandoned", "hang", ...
    failure: str | None = None  # why it is unacceptable; None when it is fine
    sample: dict | None = None  # what came back, kept for failures

    @property
    def ok(self) -> bool:
        return self.failure is None


def openai_error_shape(body: bytes) -> bool:
    """True for `{"error": {"message": str, "type": str, ...}}`."""
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return False
    return isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


def classify_response(status: int, headers: dict[str, str], body: bytes, expect: Expect) -> Outcome:
    """An HTTP answer judged against `expect` (header names in lower case). A 2xx is only the
    status: whether its content is right is the action's to check."""
    label = str(status)
    sample = {"status": status, "body": body[:SAMPLE_CHARS].decode("utf-8", "replace")}
    if status not in expect.statuses:
        why = "server error" if status >= 500 else "unexpected status"
        return Outcome(label, f"{why} {status} (accepted: {', '.join(map(str, sorted(expect.statuses)))})", sample)
    if status < 400:
        return Outcome(label)
    if not openai_error_shape(body):
        return Outcome(f"{label} not OpenAI-shaped", f"a {status} without the OpenAI error shape", sample)
    if status in RETRY_LATER and "retry-after" not in headers:
        return Outcome(f"{label} without Retry-After", f"a {status} without Retry-After", sample)
    return Outcome(label)


def is_timeout(exc: BaseException) -> bool:
    import httpx
    import openai

    return isinstance(exc, (TimeoutError, socket.timeout, httpx.TimeoutException, openai.APITimeoutError))


def is_closed(exc: BaseException) -> bool:
    import httpx
    import openai

    return isinstance(exc, (ConnectionError, http.client.RemoteDisconnected, http.client.IncompleteRead,
                            httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, openai.APIConnectionError))


def classify_exception(exc: BaseException, expect: Expect, timeout_s: float) -> Outcome:
    """A request that ended in an exception on the client's side."""
    sample = {"exception": f"{type(exc).__name__}: {exc}"[:SAMPLE_CHARS]}
    if is_timeout(exc):  # before `is_closed`: openai's timeout is a kind of connection error
        return Outcome("hang", f"no answer within {timeout_s:g} s", sample)
    if is_closed(exc):
        return Outcome("closed", None if expect.closed_ok else "the server closed the connection", sample)
    return Outcome("client error", f"{type(exc).__name__}: {exc}", sample)


@dataclass(slots=True)
class Slot:
    """One request in flight: its action fills in `outcome` (and may add to `what`)."""

    action: str
    expect: Expect
    what: dict = field(default_factory=dict)  # the request, for a failure's sample
    outcome: Outcome | None = None


class Ledger:
    """Counts, thread-safe: requests opened per action, outcomes per (action, label), failure
    samples, and when each outcome came (for outcomes per second)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self.opened: Counter[str] = Counter()
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.failed: Counter[tuple[str, str]] = Counter()  # (action, label) pairs that are failures
        self.samples: list[dict] = []
        self.events: list[tuple[float, str, bool]] = []  # (seconds since start, label, acceptable)
        self.notes: dict[str, list[dict]] = {}  # what actions report beside outcomes (e.g. each burst)

    @contextlib.contextmanager
    def request(self, action: str, expect: Expect, **what) -> Iterator[Slot]:
        """Opens a request; the body sets `slot.outcome`. An exception is judged here; a body that
        sets no outcome leaves the request unaccounted (a flaw of the soak, shown as such)."""
        slot = Slot(action, expect, dict(what))
        with self._lock:
            self.opened[action] += 1
        try:
            yield slot
        except Exception as e:  # noqa: BLE001 - every way a request can end is an outcome
            slot.outcome = classify_exception(e, expect, self.timeout_s)
        if slot.outcome is not None:
            self.record(slot)

    def record(self, slot: Slot) -> None:
        out = slot.outcome
        with self._lock:
            key = (slot.action, out.label)
            self.outcomes[key] += 1
            self.events.append((time.monotonic() - self.t0, out.label, out.ok))
            if out.ok:
                return
            self.failed[key] += 1
            if self.failed[key] <= MAX_SAMPLES_PER_KIND:
                self.samples.append({"action": slot.action, "outcome": out.label, "why": out.failure,
                                     "at_s": round(time.monotonic() - self.t0, 1), "request": slot.what,
                                     "got": out.sample})

    def crash(self, action: str, exc: BaseException, trace: str) -> None:
        """An action that raised outside its requests: a flaw of the soak, counted as one failed request."""
        slot = Slot(action, Expect.of(), {"traceback": trace[-2000:]})
        slot.outcome = Outcome("soak error", f"the action raised {type(exc).__name__}: {exc}")
        with self._lock:
            self.opened[action] += 1
        self.record(slot)

    def note(self, kind: str, entry: dict) -> None:
        with self._lock:
            self.notes.setdefault(kind, []).append(entry)

    # -- totals --------------------------------------------------------------------------------

    def totals(self) -> tuple[int, int, int]:
        """(requests opened, judged, failures)."""
        with self._lock:
            return sum(self.opened.values()), sum(self.outcomes.values()), sum(self.failed.values())

    def by_label(self) -> Counter[str]:
        with self._lock:
            out: Counter[str] = Counter()
            for (_, label), count in self.outcomes.items():
                out[label] += count
            return out

    def table(self) -> dict[str, dict]:
        """Per action: requests opened, outcomes by label, the failing ones among them, failures,
        unaccounted (opened, never judged)."""
        with self._lock:
            rows = {}
            for action in sorted(self.opened):
                outcomes = {label: c for (a, label), c in sorted(self.outcomes.items()) if a == action}
                judged = sum(outcomes.values())
                failed = {label: c for (a, label), c in sorted(self.failed.items()) if a == action}
                rows[action] = {"opened": self.opened[action], "outcomes": outcomes, "failed": failed,
                                "failures": sum(failed.values()), "unaccounted": self.opened[action] - judged}
            return rows
