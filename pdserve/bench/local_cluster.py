"""`pdserve serve` as a child process of a benchmark: started, waited for, stopped; what its
supervisor reports meanwhile (children that exited, were restarted, are ready again, crash-loop)
collected with the time each line arrived."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable


def stop_serve(proc: subprocess.Popen) -> None:
    """Stop a `pdserve serve` process: SIGTERM (it stops its children), SIGKILL after a minute (its
    children then get SIGTERM from the kernel: PR_SET_PDEATHSIG)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class LocalCluster:
    """`pdserve serve --port 0 ...` as a child until `stop()`: its ready line parsed (`ready`, `url`,
    `pids` by process name), its stderr in `log_path` (or dropped), `env` added to its environment
    (secrets go there, never on a command line). While it starts, `progress(seconds)` is called
    every 15 s (a first run converts the model: minutes). After the ready line, every JSON line
    the launcher prints (its supervisor's events) is appended to `events` as it comes, with `at`:
    the monotonic time it arrived."""

    def __init__(self, model: str, extra: list[str], timeout_s: float = 900.0, log_path: Path | None = None,
                 env: dict[str, str] | None = None, progress: Callable[[float], None] | None = None) -> None:
        argv = [sys.executable, "-m", "pdserve.cli", "serve", "--model", model, "--port", "0", *extra]
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = log_path.open("w") if log_path is not None else None
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log or subprocess.DEVNULL, text=True,
                                     env={**os.environ, **(env or {})})
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        start = time.monotonic()
        while reader.is_alive() and time.monotonic() - start < timeout_s:
            reader.join(min(15.0, max(0.0, timeout_s - (time.monotonic() - start))))
            if reader.is_alive() and progress is not None:
                progress(time.monotonic() - start)
        if not line or not line[0].startswith("{"):
            self.stop()
            where = f"; see {log_path}" if log_path is not None else ""
            raise RuntimeError(f"the cluster (pdserve serve {' '.join(extra)}) did not start{where}")
        self.ready = json.loads(line[0])
        self.url: str = self.ready["url"]
        self.pids: dict[str, int] = {p["name"]: p["pid"] for p in self.ready["processes"]}
        self.events: list[dict] = []
        threading.Thread(target=self._read_events, daemon=True, name="cluster-events").start()

    def _read_events(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                try:
                    self.events.append({**json.loads(line), "at": time.monotonic()})
                except ValueError:
                    pass

    def stop(self) -> None:
        """SIGTERM (the launcher stops its children), then SIGKILL after a minute."""
        stop_serve(self.proc)
        if self.log is not None:
            self.log.close()
