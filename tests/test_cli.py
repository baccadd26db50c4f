"""The `pdserve` command, run as a user runs it."""

import json
import subprocess
import sys

from pdserve.cli import main


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


def test_export_round_trips(tmp_path, tiny_llama):
    assert main(["export", str(tiny_llama), str(tmp_path / "copy")]) == 0
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"]:
        assert (tmp_path / "copy" / name).exists()


def test_bad_model_path_is_a_clear_error(capsys):
    assert main(["generate", "--model", "/no/such/model", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err
