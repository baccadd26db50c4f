"""The soak's traffic mix: every kind of action, its category and weight, and how a client draws
its next one.

Each client first runs its share of one pass over every kind (client i: kinds i, i + clients, ...;
the slow kinds first, so they land on different clients; a burst last in its share, and not before
a quarter of the soak has passed: until then its client draws), so even a short soak covers them
all (a soak shorter than that pass runs it anyway);
after that it draws by weight from its own seeded generator. A burst drawn within `burst_gap_s`
of the last one, or while one runs, is drawn again: a burst loads the whole cluster for a while.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.bench.soak import abuse
from pdserve.bench.soak import malformed as bad
from pdserve.bench.soak import valid as ok
from pdserve.bench.soak.target import SoakClient


@dataclass(frozen=True, slots=True)
class Action:
    name: str  # the row of the table, e.g. "valid.chat.openai"
    category: str  # valid | malformed | abusive
    weight: float
    run: Callable[[SoakClient], None]


def _valid(chat: bool, via: str) -> Callable[[SoakClient], None]:
    return lambda s: ok.valid(s, chat, via)


# slow kinds first (see the module's docstring)
ACTIONS: tuple[Action, ...] = (
    Action("abuse.burst", "abusive", 0.15, abuse.burst),
    Action("abuse.slowloris", "abusive", 0.5, abuse.slowloris),
    Action("abuse.stalled_body", "abusive", 0.5, abuse.stalled_body),
    Action("abuse.stalled_reader", "abusive", 0.5, abuse.stalled_reader),
    Action("valid.costly", "valid", 2.0, ok.costly),
    Action("abuse.slow_body", "abusive", 1.0, abuse.slow_body),
    Action("valid.completion.openai", "valid", 10.0, _valid(False, "openai")),
    Action("valid.chat.openai", "valid", 10.0, _valid(True, "openai")),
    Action("valid.completion.httpx", "valid", 10.0, _valid(False, "httpx")),
    Action("valid.chat.httpx", "valid", 10.0, _valid(True, "httpx")),
    Action("abuse.disconnect_mid_stream", "abusive", 3.0, abuse.disconnect_mid_stream),
    Action("abuse.abandon_non_stream", "abusive", 3.0, abuse.abandon_non_stream),
    Action("malformed.bad_json", "malformed", 1.5, bad.bad_json),
    Action("malformed.wrong_type", "malformed", 2.0, bad.wrong_type),
    Action("malformed.out_of_range", "malformed", 2.0, bad.out_of_range),
    Action("malformed.lone_surrogate", "malformed", 1.0, bad.lone_surrogate),
    Action("malformed.too_many_stops", "malformed", 1.0, bad.too_many_stops),
    Action("malformed.unknown_model", "malformed", 1.0, bad.unknown_model),
    Action("malformed.wrong_key", "malformed", 1.0, bad.wrong_key),
    Action("malformed.missing_key", "malformed", 1.0, bad.missing_key),
    Action("malformed.oversized_body", "malformed", 0.3, bad.oversized_body),
    Action("malformed.oversized_chunked", "malformed", 0.3, bad.oversized_chunked),
    Action("malformed.cl_and_te", "malformed", 1.0, bad.cl_and_te),
    Action("malformed.cl_too_small", "malformed", 1.0, bad.cl_too_small),
)
CATEGORY = {a.name: a.category for a in ACTIONS}


def first_round(client: int, clients: int) -> list[Action]:
    """Client i's share of one pass; a burst last, so the others first meet a cluster not yet flooded."""
    share = list(ACTIONS[client::clients])
    return sorted(share, key=is_burst)


def is_burst(action: Action) -> bool:
    return action.run is abuse.burst


def draw(rng: random.Random, client: SoakClient) -> Action:
    """The next action by weight; a burst only from `first_burst_at` on, none running, and once
    `burst_gap_s` has passed since the last."""
    t = client.target
    while True:
        action = rng.choices(ACTIONS, weights=[a.weight for a in ACTIONS])[0]
        if action.run is not abuse.burst:
            return action
        with t.burst_lock:
            now = time.monotonic()
            if not t.burst_running and now - t.last_burst >= t.burst_gap_s and now >= t.first_burst_at:
                return action
