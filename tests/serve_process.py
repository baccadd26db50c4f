"""`pdserve serve` as a process, as an operator starts it: its events and log read as they come."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

from pdserve.bench.local_cluster import stop_serve


class ServeProcess:
    """`pdserve serve` as a process, its stdout events and stderr lines collected as they come."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", *flags], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.events: list[dict] = []
        self.log: list[str] = []
        threading.Thread(target=lambda: self.events.extend(json.loads(line) for line in self.proc.stdout),
                         daemon=True).start()
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()

    def event(self, kind: str, name: str | None = None, after: int = 0) -> dict | None:
        return next((e for e in self.events[after:] if e["event"] == kind and name in (None, e.get("name"))), None)

    def close(self) -> None:
        stop_serve(self.proc)
