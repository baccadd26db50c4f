"""Choices pdserve measures once per machine and keeps: a JSON file of entries under pdserve's
cache root, each under a key that names everything its measurement depends on, the newest
`MAX_ENTRIES` kept. Workers started together on one host take the file's lock in turn, so one
measures and the others read its answer. A file that cannot be read is measured again; one that
cannot be written leaves the answer to this process alone, and the log says so."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Iterator

import torch

from pdserve.cache import cache_path

log = logging.getLogger("pdserve.engine")

MAX_ENTRIES = 64


class MeasuredChoices:
    """One file of measured choices, `name` under the cache root; `what` names them in the log."""

    def __init__(self, name: str, what: str):
        self.name, self.what = name, what

    @property
    def path(self) -> Path:  # read each time: tests and users point XDG_CACHE_HOME elsewhere
        return cache_path(self.name)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def read(self) -> dict[str, dict]:
        path = self.path
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("%s: ignoring the unreadable cache %s (%s); measuring again", self.what, path, e)
            return {}
        return data if isinstance(data, dict) and all(isinstance(v, dict) for v in data.values()) else {}

    def write(self, key: str, entry: dict) -> None:
        path = self.path
        entries = self.read()
        entries.pop(key, None)
        entries[key] = entry  # newest last
        kept = dict(list(entries.items())[-MAX_ENTRIES:])
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(kept, indent=1))
            os.replace(tmp, path)
        except OSError as e:  # a read-only home: the choice holds for this process, measured again next time
            log.warning("%s: could not cache the choice in %s (%s)", self.what, path, e)


def machine_key(*what: object) -> str:
    """A key for a measurement of `what` on this machine: the CPU and the kernels it is let run (the
    overrides of torch, oneDNN and pdserve), torch's and pdserve's versions, and `what` (JSON)."""
    import pdserve

    from pdserve.layers.cpu import aten_capability, cpu_flags, cpu_model_name
    from pdserve.layers.kernels.native import ISA_ENV

    isa = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
    overrides = [os.environ.get(name) for name in (ISA_ENV, "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")]
    blob = json.dumps([cpu_model_name(), isa, aten_capability(), overrides, torch.__version__, pdserve.__version__,
                       *what])
    return hashlib.sha256(blob.encode()).hexdigest()[:32]
