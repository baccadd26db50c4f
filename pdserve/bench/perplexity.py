"""`pdserve bench perplexity`: a model's perplexity on a text file, computed as llama.cpp's
`llama-perplexity` computes it, and (with `--llama-perplexity PATH`) that program's on the same
model file and text, for the ratio.

llama.cpp's method, followed step for step:
1. the whole text is tokenized once, BOS first where the model adds one;
2. it is cut into chunks of `--ctx` tokens (the tail that fills no chunk is dropped), at most
   `--chunks` of them;
3. each chunk is computed on its own, its first token replaced by BOS (where the model adds one);
4. only the second half of each chunk is scored: the log-probability of each token from position
   ctx / 2 + 1 on, given the chunk's tokens before it;
5. perplexity is e to the mean negative log-probability over every scored token.
Ours comes from the prompt log-probabilities of the served engine (the same kernels, weights and
dtype a request gets); llama.cpp's is parsed from its own output ("Final estimate: PPL = ...").
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def chunks(tokens: list[int], ctx: int, limit: int | None, bos: int | None) -> list[list[int]]:
    """The text's chunks as llama-perplexity computes them (steps 2 and 3)."""
    count = len(tokens) // ctx if limit is None else min(limit, len(tokens) // ctx)
    out = []
    for i in range(count):
        chunk = tokens[i * ctx : (i + 1) * ctx]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        out.append(chunk)
    return out


def ours(model: str, text: str, ctx: int, limit: int | None, engine_args: dict) -> dict:
    from pdserve import LLM, SamplingParams

    llm = LLM(model, **engine_args)
    tokenizer = llm.engine.tokenizer
    tokens = tokenizer.encode(text)
    bos = tokenizer.bos_token_id if tokens and tokens[0] == tokenizer.bos_token_id else None
    pieces = chunks(tokens, ctx, limit, bos)
    if not pieces:
        raise ValueError(f"the text is {len(tokens)} tokens: not one chunk of {ctx}")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    started = time.perf_counter()
    nll, scored = 0.0, 0
    for i, chunk in enumerate(pieces):
        out = llm.generate([{"prompt_token_ids": chunk}], params)[0]
        for entry in out.prompt_logprobs[ctx // 2 + 1 :]:  # step 4
            nll -= entry.logprob
            scored += 1
        print(f"[{i + 1}/{len(pieces)}] perplexity so far {math.exp(nll / scored):.4f}", file=sys.stderr, flush=True)
    return {"perplexity": math.exp(nll / scored), "tokens_scored": scored, "chunks": len(pieces),
            "text_tokens": len(tokens), "seconds": time.perf_counter() - started, "dtype": str(llm.engine.dtype)}


def llama_cpp(binary: Path, model: str, text_file: Path, ctx: int, limit: int | None, threads: int) -> dict:
    command = [str(binary), "-m", model, "-f", str(text_file), "-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
    if limit is not None:
        command += ["--chunks", str(limit)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    found = _FINAL.search(done.stdout + done.stderr)
    if done.returncode or not found:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
    return {"perplexity": float(found.group(1)), "plus_minus": float(found.group(2)), "command": command,
            "seconds": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench perplexity", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory or .gguf file (or a name pdserve knows)")
    parser.add_argument("--text", type=Path, required=True, help="held-out text, UTF-8")
    parser.add_argument("--ctx", type=int, default=512, help="tokens a chunk (llama-perplexity's -c)")
    parser.add_argument("--chunks", type=int, help="at most this many chunks (default: all the text fills)")
    parser.add_argument("--dtype", default="float32", help="ours: the activations' dtype (llama.cpp computes in float32)")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for both (default: torch's choice)")
    parser.add_argument("--llama-perplexity", type=Path, help="llama.cpp's llama-perplexity, run on the same file")
    parser.add_argument("--out", type=Path, default=Path("results/perplexity.json"))
    args = parser.parse_args(argv)
    if args.ctx < 4:
        parser.error("--ctx must be at least 4")
    from pdserve.models.registry import resolve_model

    model = resolve_model(args.model)
    text = args.text.read_text(encoding="utf-8")
    engine_args = {"dtype": args.dtype, "quantization": args.quantization, "max_model_len": args.ctx + 1,
                   "num_threads": args.threads, "enable_prefix_caching": False}
    result = {"model": model, "text": str(args.text), "ctx": args.ctx, "ours": ours(model, text, args.ctx, args.chunks,
                                                                                   engine_args)}
    line = f"perplexity (ctx {args.ctx}, {result['ours']['chunks']} chunks): ours {result['ours']['perplexity']:.4f}"
    if args.llama_perplexity:
        import torch

        theirs = result["llama_cpp"] = llama_cpp(args.llama_perplexity, model, args.text, args.ctx, args.chunks,
                                                 args.threads or torch.get_num_threads())
        result["ours_over_llama_cpp"] = result["ours"]["perplexity"] / theirs["perplexity"]
        line += (f" | llama.cpp {theirs['perplexity']:.4f} +/- {theirs['plus_minus']:.4f}"
                 f" | ours/llama.cpp {result['ours_over_llama_cpp']:.4f}")
    print(line, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
