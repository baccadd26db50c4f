"""The engine's flags, generated from EngineConfig's fields: every flag parses into the config it
names, and the argv `pdserve serve` hands a worker parses there into the same config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from pdserve.cli import build_parser, engine_argv, engine_kwargs
from pdserve.config import EngineConfig
from pdserve.flags import Option, add_flags, flag, options

MODEL = "some-model"
# Values for flags whose type suggests none the config accepts.
STRING_VALUES = {"model": "tiny", "dtype": "bfloat16", "device": "cuda", "kv_cache_memory": "512MiB", "host_kv_memory": "2GiB", "disk_kv_path": "/var/cache/pdserve", "disk_kv_memory": "20GiB", "kv_store": "unix:///run/pdserve/valkey.sock",
                 "speculative": "draft:/models/small"}


def non_default(o: Option) -> tuple[list[str], object]:
    """(argv that sets the flag to a value other than its default, that value as the config takes it)."""
    if o.type is bool:
        return [o.name], not o.default
    if o.choices:
        value = next(c for c in o.choices if c != o.default)
    elif o.type in (int, float):
        value = o.type(o.default * 2 if o.default else 2)
    else:
        assert o.field in STRING_VALUES, f"give {o.name} a value in STRING_VALUES"
        value = STRING_VALUES[o.field]
    return [o.name, str(value)], value


def config(args) -> EngineConfig:
    return EngineConfig(model=MODEL, **engine_kwargs(args))


ENGINE_FLAGS = [o for o in options(EngineConfig) if o.field != "model"]


def test_every_engine_setting_is_a_flag_but_the_role():
    flagged = {o.field for o in options(EngineConfig)}
    assert {f.name for f in dataclasses.fields(EngineConfig)} - flagged == {"role"}  # the worker's --role


def test_todays_flag_names_still_parse():
    args = build_parser().parse_args(["worker", "--model", "tiny", "--no-prefix-caching", "--threads", "3",
                                      "--max-queue-wait", "5", "--kv-cache-memory", "8MiB"])
    assert args.model == "tiny"
    cfg = config(args)
    assert (cfg.enable_prefix_caching, cfg.num_threads, cfg.max_queue_wait_s, cfg.kv_cache_memory) == (
        False, 3, 5.0, 8 << 20)


@pytest.mark.parametrize("command", ["generate", "worker", "serve"])
def test_no_flags_parse_into_the_default_config(command):
    args = build_parser().parse_args([command])
    assert args.model is None
    assert config(args) == EngineConfig(model=MODEL)
    assert engine_argv(args) == []


@pytest.mark.parametrize("o", ENGINE_FLAGS, ids=lambda o: o.name)
def test_each_flag_sets_its_field(o):
    argv, value = non_default(o)
    expected = EngineConfig(model=MODEL, **{o.field: value})
    assert expected != EngineConfig(model=MODEL)
    assert config(build_parser().parse_args(["generate", *argv])) == expected


@pytest.mark.parametrize("o", ENGINE_FLAGS, ids=lambda o: o.name)
def test_a_worker_started_by_serve_gets_the_same_config(o):
    argv, _ = non_default(o)
    parent = build_parser().parse_args(["serve", *argv])
    child = build_parser().parse_args(["worker", *engine_argv(parent)])
    if o.field == "num_threads":  # the launcher gives each worker its threads itself
        assert engine_argv(parent) == []
    else:
        assert config(child) == config(parent)


def test_serve_hands_workers_every_flag_at_once_but_model_and_threads():
    # int4 is CPU-only; tensor parallelism refuses some of the others (compiled decode, a draft model)
    argv = [a for o in options(EngineConfig) if o.field not in ("quantization", "tensor_parallel_size")
            for a in non_default(o)[0]]
    parent = build_parser().parse_args(["serve", *argv])  # int4 is CPU-only: the device above is cuda
    child_argv = engine_argv(parent)
    assert not {"--model", "--threads"} & {a.split("=")[0] for a in child_argv}
    child = build_parser().parse_args(["worker", *child_argv])
    assert config(child) == dataclasses.replace(config(parent), num_threads=None)


def test_a_switch_that_defaults_on_needs_a_flag_that_turns_it_off():
    @dataclass
    class Settings:
        cache: bool = flag(True)

    with pytest.raises(TypeError, match="--no-"):
        add_flags(build_parser(), Settings, "settings")
