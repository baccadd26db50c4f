"""Checkpoint reading: sharded files, dtypes, and an error that names what is wrong."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.models.checkpoint import load_hf_dir
from pdserve.models.synthetic import make_model, write_model
from tests.factories import make_llm


def greedy(llm, n=8):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return llm.generate({"prompt_token_ids": [3, 14, 15, 92, 65]}, params)[0].outputs[0].token_ids


def test_sharded_checkpoint_loads_the_same(tmp_path, tiny_llama):
    ckpt = load_hf_dir(tiny_llama)
    ckpt.save(tmp_path / "sharded", max_shard_bytes=200_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert greedy(make_llm(tmp_path / "sharded")) == greedy(make_llm(tiny_llama))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_close_to_float32(tiny_llama, dtype):
    llm32 = make_llm(tiny_llama)
    llm16 = make_llm(tiny_llama, dtype=str(dtype).removeprefix("torch."))
    assert llm16.engine.runner.kv_cache.dtype == dtype
    a, b = greedy(llm32, 4), greedy(llm16, 4)
    assert a[0] == b[0]  # random weights: only the first token is stable across precisions


def test_unknown_architecture_is_named(tmp_path):
    d = write_model(tmp_path / "m", "tiny")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPTBigCodeForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTBigCodeForCausalLM"):
        LLM(str(d))


@pytest.mark.parametrize("change, message", [
    ("drop", "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    ("reshape", "'model.layers.1.mlp.up_proj.weight' has shape"),
    ("extra", "does not use: \\['model.layers.0.mlp.extra.weight'\\]"),
])
def test_bad_tensors_are_named(tmp_path, change, message):
    d = write_model(tmp_path / "m", "tiny")
    tensors = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    if change == "drop":
        del tensors[name]
    elif change == "reshape":
        tensors[name] = tensors[name][:-1].contiguous()
    else:
        tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        LLM(str(d))


def test_missing_shard_is_named(tmp_path, tiny_llama):
    ckpt = load_hf_dir(tiny_llama)
    ckpt.save(tmp_path / "s", max_shard_bytes=200_000)
    shard = sorted((tmp_path / "s").glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=shard.name):
        LLM(str(tmp_path / "s"))


def test_synthetic_models_are_deterministic_and_small(tmp_path):
    a, b = make_model("tiny", seed=3), make_model("tiny", seed=3)
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    assert a.tokenizer.backend.to_str() == b.tokenizer.backend.to_str()
    d = write_model(tmp_path / "t", "tiny")
    assert sum(f.stat().st_size for f in d.iterdir()) < 5 << 20
