"""The supervisor's restart rule (a pure function of exit times) and its loop over real processes,
driven by an injected clock: exits are restarted after a doubling backoff, a crash loop is reported
once and never given up on, and a child that stays up is forgiven its past exits."""

from __future__ import annotations

import os

import pytest

from pdserve.supervisor import RestartPolicy, Supervisor
from tests.wait import wait_for

POLICY = RestartPolicy(first_backoff_s=0.5, max_backoff_s=8.0, window_s=100.0, crash_loop_exits=4, stable_s=50.0)


def test_the_backoff_doubles_with_recent_exits_up_to_its_bound():
    exits: list[float] = []
    delays = []
    for t in range(6):
        exits.append(float(t))
        delays.append(POLICY.backoff(exits, float(t)))
    assert delays == [0.5, 1.0, 2.0, 8.0, 8.0, 8.0]  # the 4th exit in the window: a crash loop, the longest wait
    assert [POLICY.crash_looping(exits[:n], float(n - 1)) for n in range(1, 7)] == [False] * 3 + [True] * 3
    assert POLICY.backoff([0.0, 1.0, 2.0], 150.0) == 0.5  # outside the window, earlier exits do not count
    assert POLICY.backoff([0.0, 1.0, 2.0, 150.0], 150.0) == 0.5


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def supervisor():
    events: list[dict] = []
    clock = Clock()
    sup = Supervisor({**os.environ, "PDSERVE_TOKEN": "t" * 32}, POLICY, events.append, clock)
    yield sup, events, clock
    sup.stop(5.0)


def test_a_child_that_keeps_exiting_is_restarted_and_its_crash_loop_reported(supervisor):
    sup, events, clock = supervisor
    member = sup.start("bad", ["no-such-command"])  # argparse refuses it: exit code 2 at once
    for n in range(1, 7):
        wait_for(lambda: (sup.check() or True) and len([e for e in events if e["event"] == "exited"]) == n, 60,
                 f"exit {n}", state=lambda: events)
        clock.now += POLICY.max_backoff_s  # the backoff passes
        sup.check()
        assert events[-1]["event"] == "restarted" and events[-1]["restarts"] == n
    exited = [e for e in events if e["event"] == "exited"]
    assert [e["code"] for e in exited] == [2] * 6
    assert [e["restart_in_s"] for e in exited][:4] == [0.5, 1.0, 2.0, 8.0]
    loops = [e for e in events if e["event"] == "crash_loop"]
    assert len(loops) == 1 and loops[0]["name"] == "bad" and loops[0]["exits"] == 4  # reported once
    assert member.restarts == 6 and member.crash_looping  # and it is still being restarted


def test_a_child_up_long_enough_is_healthy_again(supervisor, tiny_llama):
    sup, events, clock = supervisor
    member = sup.start("router", ["no-such-command"])
    wait_for(lambda: (sup.check() or True) and events, 60, "the first exit")
    member.argv = ["router", "--model", str(tiny_llama), "--port", "0"]  # fixed: from now on it stays up
    clock.now += 1.0
    sup.check()
    assert member.exits and events[-1]["event"] == "restarted"
    member.child.wait_ready(60)
    sup.check()  # the restarted child's ready line, reported once, with its new address
    assert events[-1] == {"event": "ready_again", "name": "router", "pid": member.child.proc.pid,
                          "url": member.child.ready["url"], "load_seconds": None}
    clock.now += POLICY.stable_s
    sup.check()
    assert member.child.alive and not member.exits and not member.crash_looping
    assert [e["event"] for e in events].count("ready_again") == 1


def test_nothing_is_restarted_once_stopping(supervisor):
    sup, events, clock = supervisor
    sup.start("bad", ["no-such-command"])
    sup.stop(5.0)
    clock.now += 100
    sup.check()
    assert [e["event"] for e in events] == []


def test_no_child_outlives_a_killed_supervisor(tiny_llama):
    """Even SIGKILL to the supervisor's process leaves no orphan: each child is sent SIGTERM."""
    import signal
    import subprocess
    import sys

    script = (
        "import os, sys\n"
        "from pdserve.supervisor import Supervisor\n"
        "sup = Supervisor({**os.environ, 'PDSERVE_TOKEN': 't' * 32})\n"
        f"m = sup.start('router', ['router', '--model', {str(tiny_llama)!r}, '--port', '0'])\n"
        "m.child.wait_ready(60)\n"
        "print(m.child.proc.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert os.path.exists(f"/proc/{child}")
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        wait_for(lambda: not _running(child), 30, "the orphaned child to stop")
    finally:
        parent.kill()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has stopped
    except FileNotFoundError:
        return False
