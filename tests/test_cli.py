"""The `pdserve` command, run as a user runs it."""

import json
import subprocess
import sys

import pytest
import torch

from pdserve.cli import main
from pdserve.tokenizer import Tokenizer
from tests.factories import make_base_model, make_llm, offline_text


def run_cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_make_model_then_generate(tmp_path):
    out = tmp_path / "tiny"
    assert main(["make-model", "--preset", "tiny", "--architecture", "qwen3", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    res = run_cli("generate", "--model", str(out), "--dtype", "float32", "--kv-cache-memory", "16MiB",
                  "--max-tokens", "5", "hello there")
    assert res.returncode == 0, res.stderr
    assert "5 tokens in" in res.stderr


def test_generate_takes_a_base_models_text_as_the_prompt(tmp_path, capsys):
    # No chat template: the text is the prompt itself, as --raw makes it for a chat model.
    base = make_base_model(tmp_path / "base")
    args = ["generate", "--model", str(base), "--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-tokens", "5",
            "hello there"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--raw"]) == 0
    assert capsys.readouterr().out == plain == offline_text(make_llm(base), "hello there", 5) + "\n"


def test_export_round_trips(tmp_path, tiny_llama):
    from safetensors.torch import load_file

    copy = tmp_path / "copy"
    assert main(["export", str(tiny_llama), str(copy)]) == 0
    for name in ["config.json", "generation_config.json"]:
        assert json.loads((copy / name).read_text()) == json.loads((tiny_llama / name).read_text()), name
    original, exported = load_file(tiny_llama / "model.safetensors"), load_file(copy / "model.safetensors")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) and exported[k].dtype == original[k].dtype for k in original)
    text = "hello there, round trip"
    assert Tokenizer.from_dir(copy).encode(text) == Tokenizer.from_dir(tiny_llama).encode(text)
    assert Tokenizer.from_dir(copy).eos_token_id == Tokenizer.from_dir(tiny_llama).eos_token_id


def test_bad_model_path_is_a_clear_error(capsys):
    assert main(["generate", "--model", "/no/such/model", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--standby", "--ray"], "--standby keeps spare worker processes"),
    (["--local-kv-store", "64MiB", "--kv-store", "unix:///tmp/x.sock"], "--local-kv-store starts a store"),
    (["--local-kv-store", "64MiB", "--ray"], "--local-kv-store starts a store"),
])
def test_serve_refuses_flags_that_do_not_go_together(flags, message):
    from pdserve.cli import build_parser, cmd_serve

    with pytest.raises(SystemExit, match=message):
        cmd_serve(build_parser().parse_args(["serve", *flags]))


def test_local_kv_store_takes_a_size(capsys):
    from pdserve.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--local-kv-store", "lots"])
    assert "--local-kv-store" in capsys.readouterr().err
