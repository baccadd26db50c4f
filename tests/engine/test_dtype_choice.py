"""`--dtype auto` on a CPU: measured once per CPU, model and quantization with real engines of
both candidates, cached under a lock so that workers started together agree, and measured again
where the cache is unreadable or the model changed."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine import dtype_choice
from pdserve.engine.dtype_choice import CANDIDATES, cache_file, choose_dtype, pick, recorded_choice
from pdserve.engine.llm_engine import LLMEngine
from pdserve.models.arch_config import ArchConfig
from pdserve.models.loader import load_checkpoint
from tests.factories import assert_no_leaks

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


class CountingBuilder:
    """Builds real engines for the measurement and keeps them, to count them and check them for leaks."""

    def __init__(self) -> None:
        self.built: list[LLMEngine] = []
        self.lock = threading.Lock()

    def __call__(self, config: EngineConfig) -> LLMEngine:
        engine = LLMEngine(config)
        with self.lock:
            self.built.append(engine)
        return engine


def arch_of(model) -> ArchConfig:
    return ArchConfig.from_hf_config(load_checkpoint(str(model)).hf_config)


def test_auto_times_both_dtypes_once_and_then_reads_the_cache(tiny_llama):
    build = CountingBuilder()
    config = EngineConfig(model=str(tiny_llama))
    chosen = choose_dtype(config, CPU, arch_of(tiny_llama), build)

    assert chosen in (torch.float32, torch.bfloat16)
    assert sorted(str(e.dtype) for e in build.built) == ["torch.bfloat16", "torch.float32"]
    for engine in build.built:  # the workload's requests all finished and freed their blocks
        assert not engine.has_unfinished_requests()
        assert_no_leaks(engine.block_manager)
    entry = next(iter(json.loads(cache_file().read_text()).values()))
    assert entry["dtype"] == str(chosen).removeprefix("torch.")
    assert set(entry["seconds"]) == set(CANDIDATES)
    assert all(set(s) == {"prefill", "one stream", "batch"} and min(s.values()) > 0 for s in entry["seconds"].values())
    assert entry["dtype"] == pick(entry["seconds"])
    assert recorded_choice(str(tiny_llama)) == entry["dtype"]

    again = choose_dtype(config, CPU, arch_of(tiny_llama), build)
    assert again == chosen and len(build.built) == 2


def test_an_engine_with_dtype_auto_runs_in_the_measured_dtype(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory="4MiB", block_size=4))
    assert str(engine.dtype).removeprefix("torch.") == recorded_choice(str(tiny_llama))


def test_a_named_dtype_is_never_measured(tiny_llama, cache_home):
    build = CountingBuilder()
    for name, expected in (("float32", torch.float32), ("bf16", torch.bfloat16)):
        assert choose_dtype(EngineConfig(model=str(tiny_llama), dtype=name), CPU, arch_of(tiny_llama), build) == expected
    assert build.built == [] and not cache_home.exists()


def test_the_quantization_and_the_model_files_are_part_of_the_key(tiny_llama, tmp_path):
    build = CountingBuilder()
    arch = arch_of(tiny_llama)
    choose_dtype(EngineConfig(model=str(tiny_llama)), CPU, arch, build)
    choose_dtype(EngineConfig(model=str(tiny_llama), quantization="int8"), CPU, arch, build)
    assert len(build.built) == 4
    assert recorded_choice(str(tiny_llama), "int8") is not None

    copy = shutil.copytree(tiny_llama, tmp_path / "copy")
    choose_dtype(EngineConfig(model=str(copy)), CPU, arch, build)
    assert len(build.built) == 6  # another path is another model
    with open(copy / "config.json", "a") as f:
        f.write("\n")
    assert recorded_choice(str(copy)) is None  # a changed file is a changed model


def test_an_unreadable_cache_is_measured_again_and_rewritten(tiny_llama):
    cache_file().parent.mkdir(parents=True)
    cache_file().write_text("{not json")
    build = CountingBuilder()
    choose_dtype(EngineConfig(model=str(tiny_llama)), CPU, arch_of(tiny_llama), build)
    assert len(build.built) == 2
    assert recorded_choice(str(tiny_llama)) in CANDIDATES

    entries = json.loads(cache_file().read_text())
    for entry in entries.values():
        entry["seconds"] = {"float32": {"prefill": 1.0}}  # damaged: no bfloat16 figures
    cache_file().write_text(json.dumps(entries))
    choose_dtype(EngineConfig(model=str(tiny_llama)), CPU, arch_of(tiny_llama), build)
    assert len(build.built) == 4


def test_workers_starting_together_measure_once_and_agree(tiny_llama):
    build = CountingBuilder()
    arch = arch_of(tiny_llama)
    chosen: list[torch.dtype] = []

    def start() -> None:
        chosen.append(choose_dtype(EngineConfig(model=str(tiny_llama)), CPU, arch, build))

    threads = [threading.Thread(target=start) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(chosen) == 3 and len(set(chosen)) == 1
    assert len(build.built) == 2


def test_a_model_too_large_to_time_takes_the_rule_from_the_instruction_sets(tiny_llama, monkeypatch, cache_home):
    from pdserve.config import resolve_dtype

    monkeypatch.setattr(dtype_choice, "MAX_MEASURED_PARAMETERS", 1)
    build = CountingBuilder()
    assert choose_dtype(EngineConfig(model=str(tiny_llama)), CPU, arch_of(tiny_llama), build) == resolve_dtype("auto", CPU)
    assert build.built == [] and not cache_file().exists()


@pytest.mark.parametrize("bf16_seconds, expected", [
    ({"prefill": 0.3, "one stream": 0.9, "batch": 0.6}, "bfloat16"),  # AMX: prefill far faster
    ({"prefill": 0.95, "one stream": 0.95, "batch": 0.95}, "float32"),  # 5% is not worth the rounding
    ({"prefill": 0.89, "one stream": 0.89, "batch": 0.89}, "bfloat16"),  # just past the margin
    ({"prefill": 0.5, "one stream": 2.0, "batch": 1.2}, "float32"),  # slower decode outweighs a faster prefill
    ({"prefill": 1.4, "one stream": 1.1, "batch": 1.3}, "float32"),  # converted around every operation
])
def test_bfloat16_is_kept_only_where_it_is_clearly_faster(bf16_seconds, expected):
    fp32 = {"prefill": 1.0, "one stream": 1.0, "batch": 1.0}
    assert pick({"float32": fp32, "bfloat16": bf16_seconds}) == expected


def test_forcing_other_kernels_is_another_measurement(tiny_llama, monkeypatch):
    from pdserve.engine.dtype_choice import choice_key

    key = choice_key(str(tiny_llama), "auto")
    for name, value in (("PDSERVE_CPU_ISA", "portable"), ("ONEDNN_MAX_CPU_ISA", "AVX2")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert choice_key(str(tiny_llama), "auto") != key
    assert choice_key(str(tiny_llama), "auto") == key


def test_a_bfloat16_engine_that_cannot_run_here_leaves_float32(tiny_llama, caplog):
    """As on a CPU whose kernels refuse bfloat16: the measurement logs it, chooses float32 and
    caches that, and a worker still starts."""
    build = CountingBuilder()

    def refusing(config: EngineConfig) -> LLMEngine:
        if config.dtype == "bfloat16":
            raise RuntimeError("bfloat16 is not supported on this CPU")
        return build(config)

    with caplog.at_level("WARNING", logger="pdserve.engine"):
        assert choose_dtype(EngineConfig(model=str(tiny_llama)), CPU, arch_of(tiny_llama), refusing) == torch.float32
    assert "bfloat16 does not run here (RuntimeError: bfloat16 is not supported" in caplog.text
    entry = next(iter(json.loads(cache_file().read_text()).values()))
    assert entry["dtype"] == "float32" and set(entry["failed"]) == {"bfloat16"} and set(entry["seconds"]) == {"float32"}
    assert choose_dtype(EngineConfig(model=str(tiny_llama)), CPU, arch_of(tiny_llama), refusing) == torch.float32
    assert len(build.built) == 1  # the cached answer: nothing measured again
