"""`pdserve worker` as a real process on 127.0.0.1, started the way an operator starts one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

TOKEN = "worker-process-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def spawn(model: Path, role: str, *extra: str) -> tuple[subprocess.Popen, dict]:
    """The process and its ready line (its URL and KV offers), once it printed one."""
    cmd = [sys.executable, "-m", "pdserve.cli", "worker", "--model", str(model), "--role", role, "--port", "0",
           "--dtype", "float32", "--kv-cache-memory", "8MiB", "--block-size", "4", "--threads", "1", *extra]
    env = {**os.environ, "PDSERVE_TOKEN": TOKEN}  # prefill and decode share it; never on the command line
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()))
    reader.start()
    reader.join(120)
    assert not reader.is_alive(), "worker did not start: no ready line within 120s"
    assert line and line[0], f"worker did not start: {proc.stderr.read() if proc.poll() is not None else 'timeout'}"
    ready = json.loads(line[0])
    assert ready["event"] == "ready"
    return proc, ready
