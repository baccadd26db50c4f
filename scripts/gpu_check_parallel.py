"""Tensor parallelism and mixtures of experts on CUDA, checked against transformers: for a machine
with a GPU (a CUDA build of torch, this package and transformers importable; no network needed).

    python scripts/gpu_check_parallel.py [OUT.json]

- every tiny architecture (dense and MoE) on cuda:0, float32: greedy tokens equal transformers' on
  the same GPU (TP 1);
- with two GPUs or more: the same with `--tensor-parallel-size 2` (NCCL between the ranks, each
  rank's KV on its own GPU), experts split and whole (`expert_parallel`), equal to TP 1.
Prints one JSON line per check and a summary; exit status 1 if any check failed.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.models.synthetic import write_model  # noqa: E402

ARCHITECTURES = ["llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"]
PROMPTS = [list(range(3 + i, 40 + 5 * i)) for i in range(4)]
TOKENS = 16


def transformers_greedy(path: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to("cuda:0").eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = model.generate(torch.tensor([p], device="cuda:0"), max_new_tokens=TOKENS, do_sample=False)
            out.append(ids[0, len(p):].tolist())
    return out


def ours(path: Path, **engine) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    with LLM(str(path), device="cuda", dtype="float32", kv_cache_memory="64MiB", block_size=16, **engine) as llm:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 1
    gpus = torch.cuda.device_count()
    checks = []
    with tempfile.TemporaryDirectory() as d:
        for arch in ARCHITECTURES:
            path = write_model(Path(d) / arch, "tiny", arch)
            reference = transformers_greedy(path)
            runs = {"tp1": {}}
            if gpus >= 2:
                runs["tp2"] = {"tensor_parallel_size": 2}
                if arch.endswith(("moe", "mixtral")):
                    runs["tp2-ep"] = {"tensor_parallel_size": 2, "expert_parallel": True}
            for name, engine in runs.items():
                t = time.perf_counter()
                try:
                    got = ours(path, **engine)
                    ok, error = got == reference, None
                except Exception as e:  # reported, and the next check runs
                    ok, error = False, f"{type(e).__name__}: {e}"
                checks.append({"architecture": arch, "setting": name, "equal_to_transformers": ok, "error": error,
                               "seconds": round(time.perf_counter() - t, 1)})
                print(json.dumps(checks[-1]), flush=True)
    summary = {"device": torch.cuda.get_device_name(0), "gpus": gpus, "torch": torch.__version__,
               "passed": sum(c["equal_to_transformers"] for c in checks), "checks": len(checks)}
    print(json.dumps(summary), flush=True)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps({"summary": summary, "checks": checks}, indent=2))
    return 0 if summary["passed"] == summary["checks"] else 1


if __name__ == "__main__":
    sys.exit(main())
