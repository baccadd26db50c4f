"""Every dtype and quantization runs on CPUs with less than this one has.

A child process is told, through torch's, oneDNN's and pdserve's own overrides, to use no more than
AVX2 (an AMD EPYC without AVX-512, say) or no vector extensions at all, and serves the tiny model
in each dtype and quantization there: bfloat16 weights stay plain where oneDNN cannot pack them,
pdserve's kernels run their lower variant, and the outputs agree with float32's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pdserve.layers.kernels import native

CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from pdserve import LLM, SamplingParams
    from pdserve.layers.cpu import aten_capability, onednn_packs_bfloat16
    from pdserve.layers.kernels import native
    from tests.factories import paged_logits

    path = sys.argv[1]
    prompt = [5, 6, 7, 8, 9, 10, 11]
    runs = {}
    reference = None
    for dtype, quantization in [("float32", "none"), ("bfloat16", "none"), ("float32", "int4"),
                                ("bfloat16", "int8"), ("auto", "auto")]:
        llm = LLM(path, dtype=dtype, quantization=quantization, kv_cache_memory="8MiB")
        model = llm.engine.runner.model
        logits, tokens = paged_logits(llm, prompt, 2)
        reference = reference or logits
        runs[f"{dtype}/{quantization}"] = {
            "packed": any(isinstance(w, torch.Tensor) and w.is_mkldnn
                          for w in [model.lm_head, *[l.mlp.down_proj for l in model.layers]]),
            "weight": type(model.layers[0].mlp.down_proj).__name__.replace("Parameter", "Tensor"),
            "dtype": str(llm.engine.dtype).removeprefix("torch."),
            "first_token": tokens[0],
            "max_logit_error": max(float((a - b).abs().max()) for a, b in zip(logits, reference)),
        }
    kernels = native.load()
    print(json.dumps({"aten": aten_capability(), "onednn_bf16": onednn_packs_bfloat16(),
                      "kernels": kernels and kernels.isa_name, "scale": float(reference[0].abs().max()),
                      "runs": runs}))
""")

CPU_KINDS = {
    # what each override leaves: torch's kernels, oneDNN's instructions, pdserve's kernels
    "avx2-only": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", native.ISA_ENV: "avx2"},
    "no-simd": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", native.ISA_ENV: "portable"},
}


@pytest.mark.parametrize("kind", CPU_KINDS)
def test_every_dtype_and_quantization_runs_on_a_lesser_cpu(tiny_llama, tmp_path, kind):
    kernels = native.load()
    env = {**os.environ, **CPU_KINDS[kind], "XDG_CACHE_HOME": str(tmp_path)}
    if kernels is None:
        env.pop(native.ISA_ENV)
    elif env[native.ISA_ENV] not in kernels.supported:
        pytest.skip(f"this CPU lacks {env[native.ISA_ENV]}, the variant this case forces")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", CHILD, str(tiny_llama)], env=env, cwd=repo,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["aten"] == ("AVX2" if kind == "avx2-only" else "DEFAULT")
    assert not report["onednn_bf16"]  # oneDNN cannot pack bfloat16 weights here...
    runs = report["runs"]
    assert not any(r["packed"] for r in runs.values())  # ...so none is packed, and each still runs
    if kernels is not None:
        assert report["kernels"] == env[native.ISA_ENV]
        assert runs["float32/int4"]["weight"] == runs["bfloat16/int8"]["weight"] == "QuantizedWeight"
    assert runs["auto/auto"]["weight"] == "Tensor"  # unquantized: the tiny model's weights are float
    # random weights: only the first token is stable across precisions (as on any CPU)
    first = runs["float32/none"]["first_token"]
    assert all(r["first_token"] == first for r in runs.values()), runs
    # bfloat16 rounds to 8 bits (~1% of the logits' range over the tiny model); 4-bit weights ~10%;
    # `auto` times both dtypes here (float32 usually wins on these paths, but it is a measurement)
    auto = runs["auto/auto"]["dtype"]
    assert auto in ("float32", "bfloat16")
    bounds = {"bfloat16/none": 0.05, "float32/int4": 0.15, "bfloat16/int8": 0.05,
              "auto/auto": 0.0 if auto == "float32" else 0.05}
    for name, bound in bounds.items():
        assert runs[name]["max_logit_error"] <= bound * report["scale"], (name, runs[name])
