"""Independent pieces of simulation on every core: `fork_map(fn, items)`.

Each item runs in a forked child, which inherits the caller's state (a planner with its
workload), returns `fn(item)` as one JSON line on a pipe, and exits. At most `workers` children
run at once; results come back in the order of `items`. Nothing is pickled: results are plain
JSON, and what a child needs it already has from the fork.

Forking a process that runs other threads can leave a lock held in the child forever, so with
other threads alive, on a platform without fork, or with one worker, the items run one after
another in this process instead. A child that fails makes the whole call fail, with its error.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import traceback
from typing import Callable, TypeVar

T = TypeVar("T")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def fork_map(fn: Callable[[T], object], items: list[T], workers: int | None = None) -> list:
    workers = min(workers or usable_cores(), len(items))
    if workers <= 1 or not hasattr(os, "fork") or threading.active_count() > 1:
        return [fn(item) for item in items]
    results: list = [None] * len(items)
    running: dict[int, tuple[int, int, bytearray]] = {}  # read end -> (item index, pid, what it sent)
    next_item = 0
    try:
        while next_item < len(items) or running:
            while next_item < len(items) and len(running) < workers:
                fd, pid = _start(fn, items[next_item])
                running[fd] = (next_item, pid, bytearray())
                next_item += 1
            readable, _, _ = select.select(list(running), [], [])
            for fd in readable:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    running[fd][2].extend(chunk)
                    continue
                index, pid, sent = running.pop(fd)  # the child closed its end: it is done
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                results[index] = _result(bytes(sent), status, index)
    finally:
        for fd, (_, pid, _) in running.items():
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(fd)
    return results


def _start(fn: Callable, item) -> tuple[int, int]:
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: one result, then out without running the parent's exit handlers
        os.close(read)
        code = 0
        try:
            line = json.dumps({"ok": fn(item)})
        except BaseException:  # noqa: BLE001 - the parent reports it
            line, code = json.dumps({"error": traceback.format_exc()}), 1
        with os.fdopen(write, "w") as out:
            out.write(line)
        sys.stderr.flush()
        os._exit(code)
    os.close(write)
    return read, pid


def _result(sent: bytes, status: int, index: int):
    reply = json.loads(sent) if sent else {"error": f"exited with status {status} and no result"}
    if "error" in reply:
        raise RuntimeError(f"item {index} failed in its process:\n{reply['error']}")
    return reply["ok"]
