"""Where benchmark commands put their results."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: str | Path, result: dict) -> Path:
    """`result` as indented JSON at `path`, its folder made if needed."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return out
