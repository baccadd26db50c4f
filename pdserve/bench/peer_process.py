"""A peer that `pdserve bench compare` starts itself (`--peer-command NAME=CMD`), just before its
rows are measured, and stops right after, so that no server idles beside another's measurement.

Why: on a 2-vCPU VM, vLLM for CPU left running idle (no CPU used, 6 GB resident) made a lone
1000-token prompt's first token 1.7x slower on the same `pdserve serve` process (249 -> 419-435 ms
TTFT, back to 232-244 once vLLM stopped); a peer measured while the pdserve cluster is already
stopped never saw the reverse. Started here, each server has the machine to itself.

1. Nothing may listen at the peer's URL yet (an old server would be measured instead).
2. The command runs in a shell of its own session (its whole process group is the peer), its
   output in `log_path`; `progress(seconds)` is called every 15 s while it starts.
3. Ready when GET /v1/models answers 200; a command that exits first, or a peer not ready within
   `timeout_s`, is an error naming the log.
4. `stop()`: SIGTERM to the group, SIGKILL after a minute; it returns once the group is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import httpx

from pdserve.bench.peer import listening_pids

POLL_S = 1.0


class PeerProcess:
    def __init__(self, name: str, url: str, command: str, log_path: Path, api_key: str = "",
                 timeout_s: float = 900.0, progress: Callable[[float], None] | None = None) -> None:
        port = urlsplit(url).port
        if port is not None and listening_pids(port):
            raise RuntimeError(f"something already listens at {url}: stop it, or measure it without "
                               f"--peer-command {name}")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(command, shell=True, start_new_session=True, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        start = last_said = time.monotonic()
        while not _answers(url, headers):
            waited = time.monotonic() - start
            if self.proc.poll() is not None or waited > timeout_s:
                why = "exited" if self.proc.poll() is not None else f"was not ready in {timeout_s:.0f} s"
                self.stop()
                raise RuntimeError(f"peer {name} ({command}) {why}; see {log_path}")
            if progress is not None and time.monotonic() - last_said >= 15:
                progress(waited)
                last_said = time.monotonic()
            time.sleep(POLL_S)

    def stop(self) -> None:
        """SIGTERM to the peer's process group, SIGKILL to what is left of it after a minute; returns
        once no process of the group remains (its port is free again)."""
        for sig, grace_s in ((signal.SIGTERM, 60.0), (signal.SIGKILL, 10.0)):
            if not self._group_alive():
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            deadline = time.monotonic() + grace_s
            while self._group_alive() and time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(0.1)
        self._log.close()

    def _group_alive(self) -> bool:
        self.proc.poll()  # reaps the shell, so that a zombie does not count
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True


def _answers(url: str, headers: dict) -> bool:
    try:
        return httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
