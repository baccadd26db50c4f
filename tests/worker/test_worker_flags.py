"""The worker's flags, generated from WorkerConfig's fields: each one sets its field, the argv
`pdserve serve` builds for a worker parses back into the config it was built from, and a value no
worker could use is refused by the flag and by the config alike."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.cli import build_parser
from pdserve.flags import config_argv, options
from pdserve.launcher import worker_argv
from pdserve.worker.config import WorkerConfig
from pdserve.worker.main import worker_config

# A value other than the default for each setting, as the config holds it.
CHANGED = {"host": "10.0.0.7", "advertise_host": "fd00::7", "node_name": "ray-0a1b@10.0.0.7", "port": 0,
           "kv_port": 9100, "transfer": "tcp", "kv_transfer_dtype": "int8", "kv_lease_timeout": 5.0,
           "max_queued": 4, "record_steps": "/tmp/steps.jsonl", "router": "http://127.0.0.1:8000",
           "drain_timeout": 2.5, "fault_injection": True, "durable_kv": "pdserve-kv-123-0123456789abcdef",
           "version": "v2.1-rc_3", "otlp_traces_endpoint": "http://127.0.0.1:4318"}


def parsed(argv: list[str]) -> WorkerConfig:
    return worker_config(build_parser().parse_args(["worker", *argv]))


def test_every_setting_is_a_flag():
    assert {o.field for o in options(WorkerConfig)} == {f.name for f in dataclasses.fields(WorkerConfig)} == set(CHANGED)


def test_no_flags_parse_into_the_default_config():
    assert parsed([]) == WorkerConfig()


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_each_setting_crosses_a_command_line_unchanged(field):
    settings = WorkerConfig(**{field: CHANGED[field]})
    assert config_argv(settings) != []
    assert parsed(config_argv(settings)) == settings


def test_all_settings_at_once_cross_unchanged():
    settings = WorkerConfig(**CHANGED)
    assert parsed(config_argv(settings)) == settings


def test_serve_starts_a_worker_with_its_settings_in_flags():
    args = build_parser().parse_args(["serve", "--transfer", "tcp", "--record-steps", "/tmp/steps",
                                      "--fault-injection"])
    argv = worker_argv(args, ["--dtype=float32"], "decode", 3, "http://127.0.0.1:8000", "127.0.0.1", 2)
    worker = build_parser().parse_args(argv)
    assert (worker.command, worker.role, worker.threads, worker.dtype) == ("worker", "decode", 2, "float32")
    assert worker_config(worker) == WorkerConfig(port=0, router="http://127.0.0.1:8000", transfer="tcp",
                                                 record_steps="/tmp/steps/decode-3.jsonl", fault_injection=True)


@pytest.mark.parametrize("field, value", [("host", "evil.example/path"), ("advertise_host", "user@host"),
                                          ("node_name", "a b"), ("port", 70000), ("transfer", " , "),
                                          ("kv_lease_timeout", 0.0), ("max_queued", -1),
                                          ("durable_kv", "../../etc/passwd"), ("durable_kv", "pdserve-kv-1-0123456789abcdef\n")])
def test_a_value_no_worker_could_use_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        WorkerConfig(**{field: value})


def test_the_flag_refuses_it_with_the_same_reason(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["worker", "--node-name", "a b"])
    assert e.value.code == 2 and "--node-name: expected up to 128 letters" in capsys.readouterr().err
