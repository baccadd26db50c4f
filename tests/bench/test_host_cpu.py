"""Whose CPU a load point ran on: a busy child process is "ours" when its pid is given, and the rest
of the machine's ("others") when it is not."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from pdserve.bench.host_cpu import HostCpu, machine_cpu_s, noisy, process_cpu_s

SPIN = "import time\nend = time.time() + 1.0\nwhile time.time() < end: pass\n"


def spin_child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SPIN])


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
    meter = HostCpu([child.pid])
    time.sleep(0.8)
    ours = meter.cores()  # while it runs: an ended process can no longer be read
    child.wait()
    assert ours["ours"] >= 0.3 and ours["cores"] == len(os.sched_getaffinity(0))

    child = spin_child()
    meter = HostCpu([os.getpid()])
    child.wait()
    theirs = meter.cores()
    assert theirs["others"] >= 0.3 and theirs["ours"] < theirs["others"]
    assert noisy(theirs) and not noisy(None)
