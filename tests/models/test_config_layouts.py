"""Checkpoints whose config.json is in transformers 5's layout (as the tiny models are: re-saved by
the installed transformers) and in transformers 4's, served like transformers serves them; and
`pdserve export` writing a config both pdserve and transformers read with the same rope scaling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.models.arch_config import ArchConfig
from tests.factories import TINY_VARIANTS, make_llm, make_tiny_model, paged_logits

transformers = pytest.importorskip("transformers")

ATOL = RTOL = 1e-4  # float32 on both sides, as in test_llama_vs_hf


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def long_prompt() -> list[int]:
    # Past the tiny llama's original_max_position_embeddings (64): where llama3 scaling matters most.
    return torch.randint(0, 500, (100,), generator=torch.Generator().manual_seed(5)).tolist()


def transformers_logits(hf_model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1 :]


def test_llama3_scaling_in_rope_parameters_matches_transformers(tiny_models, hf_models, tmp_path):
    path = tiny_models["llama"]
    cfg = read_config(path)
    # transformers 5's layout: the scaling and theta live in rope_parameters only.
    assert "rope_scaling" not in cfg and "rope_theta" not in cfg
    assert cfg["rope_parameters"]["rope_type"] == "llama3"
    prompt = long_prompt()
    ours, generated = paged_logits(make_llm(path), prompt, num_decode_steps=4)
    expected = transformers_logits(hf_models["llama"], prompt, generated)
    assert len(ours) == len(expected) == 5
    for step, (a, b) in enumerate(zip(ours, expected)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"step {step}: {m}")

    # The same weights without the scaling, which is what reading only `rope_scaling` served:
    # well outside the tolerance, so the check above tells the two apart.
    unscaled = tmp_path / "unscaled"
    shutil.copytree(path, unscaled)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    (unscaled / "config.json").write_text(json.dumps(cfg))
    plain, _ = paged_logits(make_llm(unscaled), prompt, num_decode_steps=0)
    assert (plain[0] - expected[0]).abs().max() > 10 * ATOL


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_transformers_4_layout_reads_like_transformers_5(tiny_models, tmp_path, variant):
    legacy = make_tiny_model(tmp_path / variant, variant, layout="legacy")
    old, new = read_config(legacy), read_config(tiny_models[variant])
    assert "rope_theta" in old and "rope_parameters" not in old and "torch_dtype" in old
    assert "rope_theta" not in new and "rope_parameters" in new and "dtype" in new
    assert ArchConfig.from_hf_config(old) == ArchConfig.from_hf_config(new)
    # transformers too reads both as one model.
    assert (transformers.AutoConfig.from_pretrained(legacy).rope_parameters
            == transformers.AutoConfig.from_pretrained(tiny_models[variant]).rope_parameters)


def test_transformers_4_layout_llama_matches_transformers(hf_models, tmp_path):
    legacy = make_tiny_model(tmp_path / "llama", "llama", layout="legacy")
    assert read_config(legacy)["rope_scaling"]["rope_type"] == "llama3"
    prompt = long_prompt()
    ours, generated = paged_logits(make_llm(legacy), prompt, num_decode_steps=2)
    for a, b in zip(ours, transformers_logits(hf_models["llama"], prompt, generated)):  # same seed, same weights
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("layout", ["installed", "legacy"])
def test_export_keeps_rope_scaling_for_pdserve_and_transformers(tmp_path, layout):
    from pdserve.cli import main

    src = make_tiny_model(tmp_path / "src", "llama", layout=layout)
    assert main(["export", str(src), str(tmp_path / "out")]) == 0
    exported = tmp_path / "out"
    arch = ArchConfig.from_hf_config(read_config(exported))
    assert arch == ArchConfig.from_hf_config(read_config(src))
    assert arch.rope_scaling.kind == "llama3" and arch.rope_scaling.original_max_position_embeddings == 64
    expected = dict(TINY_VARIANTS["llama"]["rope_scaling"], rope_theta=10000.0)
    assert transformers.AutoConfig.from_pretrained(exported).rope_parameters == expected


@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2", "qwen3"])
def test_synthetic_models_load_in_transformers_as_written(tmp_path, architecture):
    # `pdserve make-model` output, no overrides: every tensor fits the model transformers builds
    # from the config (a Qwen3 config without head_dim once asked for 128-wide heads).
    from pdserve.models.synthetic import write_model

    path = write_model(tmp_path / architecture, "tiny", architecture)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    hf = transformers.AutoConfig.from_pretrained(path)
    arch = ArchConfig.from_hf_config(read_config(path))
    assert (arch.head_dim, arch.num_kv_heads) == (hf.head_dim, hf.num_key_value_heads)
