"""Whose CPU a load point ran on: a busy child process is "ours" when its pid is given, and the rest
of the machine's ("others") when it is not."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from pdserve.workload.host_cpu import HostCpu, machine_cpu_s, noisy, process_cpu_s

# burns half a second of its own CPU, however long a busy machine takes to give it that, says so,
# and stays (readable) until its stdin closes
SPIN = ("import sys, time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
        "print('spun', flush=True)\nsys.stdin.read()\n")


def spin_child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def spun(child: subprocess.Popen) -> None:
    assert child.stdout.readline() == "spun\n"


def let_go(child: subprocess.Popen) -> None:
    child.stdin.close()
    assert child.wait(60) == 0


def one_second_apart():
    """A clock that reads 0, then 1: the meter's rates are then CPU seconds, whatever the wall clock did."""
    ticks = iter([0.0, 1.0])
    return lambda: next(ticks)


def test_process_and_machine_counters_advance():
    busy0, _ = machine_cpu_s()
    cpu0 = process_cpu_s(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    assert process_cpu_s(os.getpid()) - cpu0 >= 0.2
    assert machine_cpu_s()[0] - busy0 >= 0.2
    assert process_cpu_s(2**22 + 7) == 0.0  # no such process: nothing, not an error


def test_a_busy_process_counts_as_ours_or_as_others():
    child = spin_child()
    meter = HostCpu([child.pid], clock=one_second_apart())
    spun(child)
    ours = meter.cores()  # while it lives: an ended process can no longer be read
    let_go(child)
    assert ours["ours"] >= 0.45 and ours["cores"] == len(os.sched_getaffinity(0))

    child = spin_child()
    meter = HostCpu([os.getpid()], clock=one_second_apart())
    spun(child)
    theirs = meter.cores()
    let_go(child)
    assert theirs["others"] >= 0.45 and theirs["ours"] < theirs["others"]
    assert noisy(theirs) and not noisy(None)
