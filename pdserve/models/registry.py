"""Model names a user may type instead of a path: `default` and the synthetic presets."""

from __future__ import annotations

import os
from pathlib import Path

from pdserve.cache import cache_path
from pdserve.models.presets import PRESETS


def models_cache_dir() -> Path:
    return cache_path("models")


def resolve_model(name: str | None) -> str:
    """A path for `name`: the default model for None/'default', a synthetic preset (written to the
    cache on first use) for 'tiny'/'demo', otherwise `name` itself."""
    if name in (None, "", "default"):
        from pdserve.models.default_model import default_model_path

        return str(default_model_path())
    if name in PRESETS and not Path(name).exists():
        out = models_cache_dir() / name
        if not (out / "config.json").exists():
            # written beside and renamed, so a concurrent reader never sees half a model
            from pdserve.models.synthetic import write_model

            tmp = out.with_name(f".{name}.{os.getpid()}")
            write_model(tmp, name)
            try:
                os.rename(tmp, out)
            except OSError:
                if not (out / "config.json").exists():
                    raise
        return str(out)
    return name
