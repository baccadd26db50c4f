"""Our model's logits against transformers' on the same checkpoint, for every architecture,
through the real paged-KV path: a whole prefill, a chunked prefill, then decode steps."""

import pytest
import torch

from pdserve.models.synthetic import write_model
from tests.factories import TINY_VARIANTS, make_llm, paged_logits

# float32 on both sides; differences come from summation order only.
ATOL = 1e-4
RTOL = 1e-4


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
@pytest.mark.parametrize("chunk", [256, 7])
def test_logits_match_transformers(tiny_models, hf_models, variant, chunk):
    llm = make_llm(tiny_models[variant], max_num_batched_tokens=chunk)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 500, (45,), generator=g).tolist()
    ours, generated = paged_logits(llm, prompt, num_decode_steps=6)
    full = torch.tensor([prompt + generated[:-1]])
    with torch.no_grad():
        ref = hf_models[variant](full).logits[0]
    expected = ref[len(prompt) - 1 :]
    assert len(ours) == len(expected) == 7
    for step, (a, b) in enumerate(zip(ours, expected)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"step {step}: {m}")


def test_one_kv_head_with_qk_norms_matches_transformers(tmp_path):
    """Qwen3 with a single KV head: its keys' norm runs over one head per row (a strided slice)."""
    from transformers import AutoModelForCausalLM

    spec = dict(TINY_VARIANTS["qwen3"], num_key_value_heads=1)
    path = write_model(tmp_path / "mqa", "tiny", spec.pop("architecture"), **spec)
    prompt = list(range(3, 30))
    ours, generated = paged_logits(make_llm(path), prompt, num_decode_steps=3)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)(
            torch.tensor([prompt + generated[:-1]])).logits[0][len(prompt) - 1 :]
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
