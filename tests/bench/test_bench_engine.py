"""The engine benchmark on a tiny model: the JSON's shape and sane numbers, never a speed."""

from __future__ import annotations

import json
import math
import resource
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import pdserve.bench.engine as bench
from pdserve.bench.machine import measure
from pdserve.bench.model_arithmetic import decode_step_bytes
from pdserve.models.arch_config import ArchConfig
from pdserve.models.synthetic import write_model

TINY_SIZES = bench.Sizes(
    prefill_lengths=(16, 40), decode_batches=(1, 3), decode_prompt_len=8, decode_steps=3,
    offline_requests=5, offline_prompt_range=(4, 24), offline_new_tokens=4, hf_batch=2, reps=1, offline_reps=2,
    default_decode_steps=3, matmul_size=64, buffer_mib=4, kv_cache_memory="8MiB",
)


@pytest.fixture(autouse=True)
def one_thread(request: pytest.FixtureRequest):
    """Tiny matmuls gain nothing from a second thread, and lose a lot when another process holds
    the second core (the threads wait on each other); one thread keeps the test fast either way.
    The slow test runs the real benchmark, with the threads it would have."""
    threads = torch.get_num_threads()
    if request.node.get_closest_marker("slow") is None:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("bench") / "tiny", "tiny")


def _numbers(tree: Any, path: str = ""):
    """Every (path, number) in a JSON tree; booleans are not numbers here."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _numbers(value, f"{path}.{key}")
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _numbers(value, f"{path}[{i}]")
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield path, tree


def test_machine_limits_are_positive():
    limits = measure("bfloat16", matmul_size=64, buffer_mib=4, reps=1)
    assert limits.dtype == "bfloat16"
    assert limits.threads >= 1
    assert limits.matmul_gflops > 0 and limits.read_gbs > 0 and limits.copy_gbs > 0


def test_run_reports_every_configuration(tiny: Path, capsys: pytest.CaptureFixture[str]):
    results = bench.run(tiny, ["float32", "bfloat16"], TINY_SIZES, seed=1, with_hf=True, with_default_model=False)
    results = json.loads(json.dumps(results))  # all of it must survive the trip to disk

    assert results["seed"] == 1 and "flop_count" in results and "byte_count" in results
    assert "default_model" not in results
    for dtype in ("float32", "bfloat16"):
        section = results["dtypes"][dtype]
        assert section["machine"]["dtype"] == dtype
        assert [r["prompt_tokens"] for r in section["prefill"]] == [16, 40]
        assert [r["batch"] for r in section["decode"]] == [1, 3]
        for row in section["prefill"]:
            assert set(row["ours"]) == {"seconds", "tokens_per_s", "mfu_pct", "mfu_incl_attention_pct"}
            assert row["ours"]["mfu_incl_attention_pct"] > row["ours"]["mfu_pct"]
            assert "transformers" in row and "ours_over_transformers" in row
        for row in section["decode"]:
            assert row["ours"]["tokens"] == row["batch"] * TINY_SIZES.decode_steps  # every step, whole batch
            assert row["transformers"]["tokens"] == row["batch"] * TINY_SIZES.decode_steps
            assert "mbu_pct" in row["ours"] and "ours_over_transformers" in row
        offline = section["offline"]
        assert offline["output_tokens"] == TINY_SIZES.offline_requests * TINY_SIZES.offline_new_tokens
        assert offline["transformers"]["static_batch"] == TINY_SIZES.hf_batch
        assert section["memory"]["peak_rss_bytes"] >= section["memory"]["weight_bytes"]
        bad = [(p, v) for p, v in _numbers(section) if not (v > 0 and math.isfinite(v))]
        assert not bad, f"non-positive or infinite numbers: {bad}"

    # One summary line per configuration: machine, each prefill and decode, offline, memory.
    lines = capsys.readouterr().out.strip().splitlines()
    per_dtype = 1 + len(TINY_SIZES.prefill_lengths) + len(TINY_SIZES.decode_batches) + 1 + 1
    assert len(lines) == 2 * per_dtype
    assert sum("ours/transformers" in line for line in lines) == 2 * (per_dtype - 2)


def test_byte_count_matches_the_model(tiny: Path):
    """A decode step's weight bytes are every parameter of the built model but the embedding table."""
    results = bench.run(tiny, ["float32"], TINY_SIZES, with_hf=False, with_default_model=False)
    cfg = ArchConfig.from_hf_config(json.loads((tiny / "config.json").read_text()))
    embedding_bytes = cfg.vocab_size * cfg.hidden_size * 4
    weight_bytes = results["dtypes"]["float32"]["memory"]["weight_bytes"]
    assert decode_step_bytes(cfg, 4, batch=1, mean_context=0) == weight_bytes - embedding_bytes
    assert "transformers" not in results["dtypes"]["float32"]["decode"][0]


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def test_main_writes_the_json(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(bench, "QUICK", TINY_SIZES)
    out = tmp_path / "results" / "bench.json"
    argv = ["--model", str(tiny), "--dtype", "float32", "--quick", "--no-transformers", "--no-default-model",
            "--out", str(out)]
    peak_before, started = _peak_rss(), time.time()
    assert bench.main(argv) == 0
    took, peak_after = time.time() - started, _peak_rss()
    results = json.loads(out.read_text())
    assert results["quick"] is True
    assert list(results["dtypes"]) == ["float32"]
    # this process's own clock and peak RSS bracket what the benchmark reports of its run
    assert 0 < results["wall_seconds"] <= took and peak_before <= results["peak_rss_bytes"] <= peak_after


@pytest.mark.slow
def test_quick_run_with_the_default_model(tmp_path: Path):
    """The real thing: demo model, both dtypes, transformers, the default GGUF and llama.cpp."""
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["dtypes"]) == {"float32", "bfloat16"}
    default = results["default_model"]
    if "skipped" not in default:
        assert default["float32"]["ours"]["tokens_per_s"] > 0
        assert default["bfloat16"]["ours"]["tokens_per_s"] > 0
