"""Where pdserve keeps what it computes once per machine: converted models, built kernels,
compiled graphs, measured choices. One root, `$XDG_CACHE_HOME/pdserve` (default
`~/.cache/pdserve`); no torch here, the router reads models through it too."""

from __future__ import annotations

import os
from pathlib import Path


def cache_path(*parts: str) -> Path:
    """`parts` under pdserve's cache root."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "pdserve", *parts)
