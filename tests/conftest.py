from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.factories import TINY_VARIANTS, make_tiny_model

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: make_tiny_model(root / name, name) for name in TINY_VARIANTS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def hf_models(tiny_models: dict[str, Path]):
    """transformers' implementation of each tiny checkpoint: the reference for our outputs."""
    from transformers import AutoModelForCausalLM

    return {
        name: AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        for name, path in tiny_models.items()
    }
