"""`pdserve bench-structured`: what structured outputs cost on this machine, in one run.

1. Masks: a matcher of a JSON schema, and of JSON-object mode, follows a fixed valid document
   token by token (the model's own tokenizer): microseconds to build the matcher, and to mask and
   advance it per token (median and p90 over `--rounds` passes).
2. Throughput: the offline engine answers `--requests` prompts at once, `--max-tokens` tokens
   each (greedy), without a structure and inside a JSON schema whose answers run to the length
   limit (a long array), taking turns, the best of `--rounds` each: output tokens per second, and
   the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from pdserve.bench.machine import environment
from pdserve.bench.turns import best_in_turns
from pdserve.workload.results import write_json

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["mathematics", "poetry", "engines"]}
LONG_ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 512}


def _say(message: str) -> None:
    print(f"[bench-structured] {message}", file=sys.stderr, flush=True)


def mask_costs(engine, rounds: int) -> dict:
    """Per schema: the matcher's build time and the mask + advance time per token, in microseconds."""
    from pdserve.engine.structured import Structures
    from pdserve.sampling_params import Structure

    structures = Structures(engine.tokenizer, engine.model_config.vocab_size, tuple(sorted(engine.scheduler.eos_token_ids)))
    tokens = engine.tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    structures.matcher(Structure("json", '{"type": "object"}'), [])  # the tokenizer, built once (~0.3 s)
    words = (engine.model_config.vocab_size + 31) // 32
    row = np.zeros(words, dtype=np.int32)
    out = {}
    for name, schema in (("json schema", PERSON), ("json object", {"type": "object"})):
        build, per_token = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            matcher = structures.matcher(Structure("json", json.dumps(schema)), [])
            build.append(time.perf_counter() - t0)
            for token in tokens:
                t0 = time.perf_counter()
                matcher.fill(row)
                if not matcher.consume(token):
                    raise RuntimeError(f"{name}: the document's token {token} was refused")
                per_token.append(time.perf_counter() - t0)
        out[name] = {"tokens": len(tokens), "build_us": round(statistics.median(build) * 1e6, 1),
                     "token_us_median": round(statistics.median(per_token) * 1e6, 1),
                     "token_us_p90": round(sorted(per_token)[int(0.9 * len(per_token))] * 1e6, 1)}
        _say(f"{name}: build {out[name]['build_us']} us, mask + advance {out[name]['token_us_median']} us a token "
             f"(p90 {out[name]['token_us_p90']})")
    return out


def throughput(llm, requests: int, max_tokens: int, rounds: int) -> dict:
    from pdserve import SamplingParams
    from pdserve.sampling_params import Structure

    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(f"List {n} numbers, as a JSON array: ")} for n in range(requests)]
    plain = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    shaped = plain.clone(structure=Structure("json", json.dumps(LONG_ARRAY)))
    counted: dict[str, int] = {}

    def run(name: str, params):
        def once(_) -> float:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            counted[name] = sum(len(o.outputs[0].token_ids) for o in outs)
            return time.perf_counter() - t0
        return once

    best = best_in_turns([None] * (rounds + 1), {"plain": run("plain", plain), "json schema": run("json schema", shaped)})
    result = {name: {"output_tokens": counted[name], "seconds": round(s, 3), "tok_s": round(counted[name] / s, 1)}
              for name, s in best.items()}
    result["json_schema_over_plain"] = round(result["json schema"]["tok_s"] / result["plain"]["tok_s"], 3)
    _say(f"{requests} x {max_tokens} tokens: plain {result['plain']['tok_s']} tok/s, inside a JSON schema "
         f"{result['json schema']['tok_s']} ({result['json_schema_over_plain']}x)")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench-structured", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--result-json", default="results/bench_structured.json")
    args = p.parse_args(argv)
    if min(args.requests, args.max_tokens, args.rounds) < 1:
        p.error("--requests, --max-tokens and --rounds must be positive")
    from pdserve import LLM
    from pdserve.models.registry import resolve_model

    llm = LLM(resolve_model(args.model), dtype=args.dtype, kv_cache_memory="512MiB")
    result = {"model": args.model or "default", "dtype": str(llm.engine.dtype).removeprefix("torch."),
              "environment": environment(), "masks": mask_costs(llm.engine, args.rounds),
              "throughput": throughput(llm, args.requests, args.max_tokens, args.rounds)}
    print(json.dumps(result, indent=2))
    _say(f"wrote {write_json(args.result_json, result)}")
    return 0
