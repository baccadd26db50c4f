"""The supervisor's restart rule (a pure function of exit times) and its loop over real processes,
driven by an injected clock: exits are restarted after a doubling backoff, a crash loop is reported
once and never given up on, and a child that stays up is forgiven its past exits. Fake children
(a tiny program in place of the interpreter) act out the failures: a ready child killed and
restarted, one that exits before its ready line (named; `pdserve serve` returns 1), and one that
ignores SIGTERM (killed after the grace)."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys

import pytest

from pdserve.supervisor import Child, RestartPolicy, Supervisor
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


# A stand-in for `python -m pdserve.cli ARGV`: the supervisor starts `sys.executable`, so the tests
# below point that at this program, which acts out its first argument instead of serving:
#   exit      exits with code 3 before any ready line (a wrong flag, a missing model)
#   ready     prints a ready line, then waits to be stopped
#   stubborn  ignores SIGTERM, prints a ready line, then waits (only SIGKILL ends it)
#   router    like `ready`; worker: like `exit` (for `run_serve`)
FAKE_CHILD = """\
import json, os, signal, sys, time
what = sys.argv[3]  # after "-m pdserve.cli"
if what in ("exit", "worker"):
    sys.exit(3)
if what == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if sys.argv[-1] == "--standby" and what == "slow-standby":  # still loading, as long as the test runs
    time.sleep(600)
if sys.argv[-1] == "--standby":  # load, say so, wait for "go" (or for stdin to close: exit)
    print(json.dumps({"event": "standby", "pid": os.getpid(), "load_seconds": 0.5}), flush=True)
    if sys.stdin.readline().strip() != "go":
        sys.exit(0)
print(json.dumps({"event": "ready", "url": f"http://127.0.0.1:{1000 + os.getpid() % 1000}",
                  "load_seconds": 0.0}), flush=True)
while True:
    time.sleep(1)
"""


@pytest.fixture
def fake_children(tmp_path, monkeypatch):
    program = tmp_path / "fake-python"
    program.write_text(f"#!{sys.executable}\n{FAKE_CHILD}")
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(sys, "executable", str(program))


def test_a_child_that_dies_after_it_was_ready_is_restarted_and_ready_again(supervisor, fake_children):
    sup, events, clock = supervisor
    member = sup.start("w", ["ready"])
    member.child.wait_ready(30)
    old_pid = member.child.proc.pid
    os.kill(old_pid, signal.SIGKILL)
    wait_for(lambda: (sup.check() or True) and events, 30, "the exit to be noticed")
    assert events == [{"event": "exited", "name": "w", "code": -signal.SIGKILL, "restart_in_s": 0.5}]
    sup.check()  # the backoff has not passed: nothing yet
    assert len(events) == 1 and not member.child.alive
    clock.now += 0.5
    sup.check()
    new_pid = member.child.proc.pid
    assert new_pid != old_pid and events[-1] == {"event": "restarted", "name": "w", "restarts": 1, "pid": new_pid}
    again = member.child.wait_ready(30)
    sup.check()
    assert events[-1] == {"event": "ready_again", "name": "w", "pid": new_pid, "url": again["url"],
                          "load_seconds": 0.0}
    assert member.child.alive and member.restarts == 1 and not member.crash_looping


def test_a_standby_takes_the_place_of_a_child_that_dies(supervisor, fake_children):
    """A member with a standby: the spare starts once the child is ready, says it waits; the child
    is killed; at the restart the spare goes on (no new process), and a new spare starts once it is
    ready. At stop no spare outlives the supervisor."""
    sup, events, clock = supervisor
    member = sup.start("w", ["ready"], standby=True)
    member.child.wait_ready(30)
    wait_for(lambda: (sup.check() or True) and any(e["event"] == "standby" for e in events), 30, "a standby")
    spare = member.standby
    assert events[-1] == {"event": "standby", "name": "w", "pid": spare.proc.pid, "load_seconds": 0.5}
    os.kill(member.child.proc.pid, signal.SIGKILL)
    wait_for(lambda: (sup.check() or True) and events[-1]["event"] == "exited", 30, "the exit to be noticed")
    clock.now += 0.5
    sup.check()
    assert member.child is spare and events[-1] == {"event": "restarted", "name": "w", "restarts": 1,
                                                    "pid": spare.proc.pid, "standby": True}
    again = spare.wait_ready(30)
    wait_for(lambda: (sup.check() or True) and events[-1]["event"] == "standby", 30, "the next standby")
    assert [e["event"] for e in events] == ["standby", "exited", "restarted", "ready_again", "standby"]
    assert events[3]["url"] == again["url"] and member.standby is not None and member.standby is not spare
    next_spare = member.standby
    sup.stop(5.0)
    assert not spare.alive and not next_spare.alive


def test_a_standby_not_yet_waiting_is_not_used(supervisor, fake_children, monkeypatch):
    sup, events, clock = supervisor
    member = sup.start("w", ["slow-standby"], standby=True)
    member.child.wait_ready(30)
    sup.check()
    loading = member.standby
    assert loading is not None and not loading.standing_by
    os.kill(member.child.proc.pid, signal.SIGKILL)
    wait_for(lambda: (sup.check() or True) and events and events[-1]["event"] == "exited", 30, "the exit to be noticed")
    clock.now += 0.5
    sup.check()
    assert member.child is not loading and member.standby is loading and "standby" not in events[-1]
    member.child.wait_ready(30)
    sup.stop(5.0)
    assert not loading.alive


def test_a_child_that_exits_before_it_is_ready_is_named(fake_children):
    child = Child("prefill worker 0", ["exit"], None, dict(os.environ))
    with pytest.raises(RuntimeError, match=r"^prefill worker 0 exited with code 3 before it was ready$"):
        child.wait_ready(10)


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(fake_children):
    sup = Supervisor(dict(os.environ), POLICY)
    polite, stubborn = sup.start("polite", ["ready"]), sup.start("stubborn", ["stubborn"])
    try:
        polite.child.wait_ready(30)
        stubborn.child.wait_ready(30)  # its SIGTERM handler is in place before its ready line
        sup.stop(0.5)
        assert polite.child.proc.returncode == -signal.SIGTERM
        assert stubborn.child.proc.returncode == -signal.SIGKILL
    finally:
        for member in (polite, stubborn):
            if member.child.alive:  # what stop() should have ended: no process outlives the test
                member.child.proc.kill()
                member.child.proc.wait()


def test_serve_fails_its_start_when_a_worker_exits_before_it_is_ready(fake_children, capsys):
    """The router comes up, the first worker exits at once: `run_serve` names it, stops the router
    and returns 1 (the command's exit code)."""
    from pdserve.cli import build_parser, engine_argv
    from pdserve.launcher import run_serve

    args = build_parser().parse_args(["serve", "--port", "0", "--ready-timeout", "10", "--prefill", "1"])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert run_serve(args, engine_argv(args)) == 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    out, err = capsys.readouterr()
    assert "prefill worker 0 exited with code 3 before it was ready" in err
    assert [json.loads(line)["event"] for line in out.splitlines()] == ["stopped"]
