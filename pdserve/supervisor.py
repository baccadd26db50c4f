"""Child processes kept alive: what `pdserve serve` runs its router and workers under.

Lifecycle of one supervised child:
1. Started; its first JSON line on stdout is its ready line (`ready`).
2. It exits, whatever the reason (a crash, SIGKILL, a drain that ended in exit 0): the supervisor
   reports it and starts it again after a backoff that doubles with each exit in the recent
   window, so a child that keeps dying is not restarted in a tight loop. A restarted child's ready
   line is reported too (`ready_again`, with its new address): when it can serve again.
3. Past `crash_loop_exits` exits in the window it is reported as crash-looping (once, on entering
   that state) and restarted at the longest backoff from then on: never given up on in silence.
   A child that stays up `stable_s` is healthy again; its backoff starts over.
   A member started with a standby (`start(..., standby=True)`) has a second process, its argv with
   `--standby`, started once the first is ready: it loads what it can and says so (`standby`),
   then waits. When the member's restart is due, the standby is told to go on (a line on its
   stdin) and becomes the member's child, ready in a fraction of a second instead of a full load;
   a new standby starts once it is ready. A standby not yet waiting is not used (a fresh child is
   started as without one).
4. `retire(member)`: SIGTERM to that child, never started again (a pool scaled down).
5. `stop()`: no more restarts; every child gets SIGTERM, then SIGKILL after a grace period.

The decision (how long to wait, whether it is a crash loop) is `RestartPolicy`, a pure function of
the exit times, so it is tested without processes.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    first_backoff_s: float = 0.2  # a first crash: back soon (a durable KV pool's streams wait for it)
    max_backoff_s: float = 30.0
    window_s: float = 120.0  # exits within this long of each other count together
    crash_loop_exits: int = 5  # this many exits in the window: a crash loop, reported
    stable_s: float = 60.0  # up this long: earlier exits are forgotten

    def recent(self, exits: list[float], now: float) -> list[float]:
        return [t for t in exits if now - t <= self.window_s]

    def backoff(self, exits: list[float], now: float) -> float:
        """Seconds to wait before starting again a child whose exits (monotonic times, the last
        one just now) are `exits`."""
        n = len(self.recent(exits, now))
        if n >= self.crash_loop_exits:
            return self.max_backoff_s
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** max(0, n - 1))

    def crash_looping(self, exits: list[float], now: float) -> bool:
        return len(self.recent(exits, now)) >= self.crash_loop_exits


def _in_child(cpus: list[int] | None, death_signal: int) -> None:
    """Run in the child before it starts: its cores, and `death_signal` should the thread that
    started it die (the supervisor's process, even by SIGKILL), so that no child outlives it
    (Linux; elsewhere skipped)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, death_signal)
    except (OSError, AttributeError):
        pass


_PR_SET_PDEATHSIG = 1


class Child:
    """One process of `pdserve` (`python -m pdserve.cli ARGV`), its ready line read as it comes."""

    def __init__(self, name: str, argv: list[str], cpus: list[int] | None, env: dict[str, str],
                 death_signal: int = signal.SIGTERM, standby: bool = False) -> None:
        self.name = name
        self.cpus = cpus
        self.proc = subprocess.Popen(  # secrets travel in the environment (only this user reads it), not argv
            [sys.executable, "-m", "pdserve.cli", *argv, *(["--standby"] if standby else [])], stdout=subprocess.PIPE,
            stdin=subprocess.PIPE if standby else None, text=True, env=env,
            preexec_fn=lambda: _in_child(cpus, death_signal))
        self.ready: dict | None = None
        self.standing_by = False  # a standby that has loaded and waits to be told to go on
        self.said_standby: dict = {}  # its `standby` line
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if self.ready is None and line.startswith("{"):
                try:
                    said = json.loads(line)
                except ValueError:
                    continue
                if isinstance(said, dict) and said.get("event") == "standby":
                    self.said_standby, self.standing_by = said, True
                else:
                    self.ready = said

    def go_on(self) -> bool:
        """A waiting standby takes over: False where it cannot be told (it is gone)."""
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while self.ready is None:
            if not self.alive:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not ready within {timeout:.0f}s")
            time.sleep(0.05)
        return self.ready

    def signal(self, sig: int) -> None:
        if self.alive:
            self.proc.send_signal(sig)


@dataclass(eq=False)
class Supervised:
    """A child and what the supervisor knows of it."""

    name: str
    argv: list[str]
    cpus: list[int] | None
    child: Child | None = None
    exits: list[float] = field(default_factory=list)  # monotonic times of its recent exits
    started_at: float = 0.0
    restart_at: float | None = None  # when to start it again (it is down until then)
    restarts: int = 0
    crash_looping: bool = False
    ready_reported: bool = False  # a restarted child's ready line was reported
    retired: bool = False  # sent away for good (`retire`): never started again
    has_standby: bool = False  # keeps a standby process loaded to take over when it exits
    standby: Child | None = None
    standby_reported: bool = False  # its standby's `standby` line was reported

    def children(self) -> list[Child]:
        return [c for c in (self.child, self.standby) if c is not None]


class Supervisor:
    """Starts children and keeps them running: call `check()` every so often (the launcher's loop).
    `report(event)` gets every exit, restart and crash loop, as a dict with an "event" key.
    Should the supervising thread die, each child gets `death_signal`: SIGTERM (it drains) under
    `pdserve serve`; SIGKILL in a Ray actor, which Ray starts again elsewhere at once."""

    def __init__(self, env: dict[str, str], policy: RestartPolicy = RestartPolicy(),
                 report: Callable[[dict], None] = lambda event: None,
                 clock: Callable[[], float] = time.monotonic, death_signal: int = signal.SIGTERM) -> None:
        self.env, self.policy, self.report, self.clock = env, policy, report, clock
        self.death_signal = death_signal
        self.members: list[Supervised] = []
        self.stopping = False

    def start(self, name: str, argv: list[str], cpus: list[int] | None = None, standby: bool = False) -> Supervised:
        member = Supervised(name, argv, cpus, has_standby=standby)
        self._launch(member)
        self.members.append(member)
        return member

    def _launch(self, member: Supervised) -> None:
        member.child = Child(member.name, member.argv, member.cpus, self.env, self.death_signal)
        member.started_at, member.restart_at = self.clock(), None
        member.ready_reported = member.restarts == 0  # the first start's readiness is the launcher's to tell

    def check(self) -> None:
        """Notice exits, schedule and perform restarts."""
        if self.stopping:
            return
        now = self.clock()
        for m in self.members:
            if m.retired:
                continue
            if m.restart_at is None and m.child is not None and not m.child.alive:
                self._exited(m, now)
            elif m.restart_at is not None and now >= m.restart_at:
                m.restarts += 1
                took_over = self._take_over(m)
                if not took_over:
                    self._launch(m)
                self.report({"event": "restarted", "name": m.name, "restarts": m.restarts,
                             "pid": m.child.proc.pid, **({"standby": True} if took_over else {})})
            elif m.child is not None and m.child.alive and m.exits and now - m.started_at >= self.policy.stable_s:
                m.exits.clear()  # up long enough: healthy again
                m.crash_looping = False
            self._keep_standby(m)
            if m.standby is not None and m.standby.standing_by and not m.standby_reported:
                m.standby_reported = True
                self.report({"event": "standby", "name": m.name, "pid": m.standby.proc.pid,
                             "load_seconds": m.standby.said_standby.get("load_seconds")})
            if not m.ready_reported and m.child is not None and m.child.ready is not None:
                m.ready_reported = True
                self.report({"event": "ready_again", "name": m.name, "pid": m.child.proc.pid,
                             "url": m.child.ready.get("url"), "load_seconds": m.child.ready.get("load_seconds")})

    def _take_over(self, m: Supervised) -> bool:
        """The member's standby, if it waits, becomes its child."""
        standby = m.standby
        if standby is None or not standby.alive or not standby.standing_by or not standby.go_on():
            return False
        m.child, m.standby = standby, None
        m.started_at, m.restart_at, m.ready_reported = self.clock(), None, False
        return True

    def _keep_standby(self, m: Supervised) -> None:
        """A member with a standby gets a new one once its child is ready (not while it loads: they
        would share its cores); one that died is forgotten, and started again so."""
        if m.standby is not None and not m.standby.alive:
            m.standby = None
        if (m.has_standby and m.standby is None and m.restart_at is None and m.child is not None
                and m.child.alive and m.child.ready is not None):
            m.standby = Child(m.name + " (standby)", m.argv, m.cpus, self.env, self.death_signal, standby=True)
            m.standby_reported = False

    def _exited(self, m: Supervised, now: float) -> None:
        m.exits = self.policy.recent(m.exits, now) + [now]
        delay = self.policy.backoff(m.exits, now)
        m.restart_at = now + delay
        self.report({"event": "exited", "name": m.name, "code": m.child.proc.returncode,
                     "restart_in_s": round(delay, 2)})
        if self.policy.crash_looping(m.exits, now) and not m.crash_looping:
            m.crash_looping = True
            self.report({"event": "crash_loop", "name": m.name, "exits": len(m.exits),
                         "window_s": self.policy.window_s, "restart_every_s": self.policy.max_backoff_s})

    def retire(self, member: Supervised) -> None:
        """SIGTERM to one child (a worker drains and exits 0), which is not started again."""
        member.retired, member.restart_at = True, None
        for child in member.children():
            child.signal(signal.SIGTERM)

    def stop(self, grace_s: float) -> None:
        """No more restarts; SIGTERM to every child (the last started first), SIGKILL after `grace_s`."""
        self.stopping = True
        children = [c for m in self.members for c in m.children()]
        for child in reversed(children):
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
