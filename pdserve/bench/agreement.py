"""`pdserve bench agreement`: greedy tokens of a model file, ours against llama.cpp's server on the
same file, prompt by prompt.

Both get the same token ids (ours tokenizes; llama-server takes ids), generate up to
`--max-tokens` greedily, each stopping at its end-of-generation tokens (llama-server's
`ignore_eos` would forbid them rather than pass them by, as ours does), and report their two most
likely tokens at every step. A prompt agrees when every token
is the same; where they first differ the report gives the position and each side's margin there
(the log-probability of its first choice minus its second's): a difference both sides see as a
near-tie (a margin under `--tie` nats on either side) is rounding, two arithmetics landing either
side of equal logits; a wide margin on both sides would be a real difference.

llama-server runs as started by `--llama-server-command` (for this run only) or is already
listening at `--llama-server` (127.0.0.1 only).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx

# Prose, code, lists, dialogue, facts, numbers: greedy continuations of each.
PROMPTS = [
    "The capital of France is", "Once upon a time, in a small village by the sea,", "def fibonacci(n):",
    "The three primary colors are", "Water boils at", "Here is a list of fruits:\n1. Apple\n2.",
    "Question: What is the largest planet in the solar system?\nAnswer:", "The quick brown fox",
    "In 1969, the first humans", "import numpy as np\n\nx = np.array([1, 2, 3])\n", "The recipe calls for",
    "Dear Sir or Madam,\n\nI am writing to", "The theory of relativity states that", "SELECT name, age FROM",
    "My favourite book is", "The weather today is", "Photosynthesis is the process by which",
    "To install the package, run", "The mitochondria is", "A haiku about autumn:\n",
    "The first law of thermodynamics", "She opened the door and saw", "for i in range(10):\n   ",
    "The population of Tokyo is", "In the beginning", "The best way to learn a language is",
    "HTTP status code 404 means", "The sum of the angles of a triangle is", "Shakespeare wrote",
    "The stock market", "A good night's sleep", "The Great Wall of China",
]


def _server_greedy(url: str, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """llama-server's greedy tokens and, at each, its first choice's log-probability minus its second's."""
    body = {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "n_probs": 2, "cache_prompt": False,
            "return_tokens": True, "post_sampling_probs": False}
    r = httpx.post(url.rstrip("/") + "/completion", json=body, timeout=600)
    r.raise_for_status()
    data = r.json()
    tokens, margins = list(data["tokens"]), []
    for step in data.get("completion_probabilities", []):
        top = step.get("top_logprobs") or step.get("probs") or []
        values = [t.get("logprob", math.log(max(t.get("prob", 0.0), 1e-30))) for t in top[:2]]
        margins.append(values[0] - values[1] if len(values) == 2 else math.inf)
    return tokens, margins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench agreement", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a .gguf file (or a name pdserve knows)")
    parser.add_argument("--llama-server", default="http://127.0.0.1:8190", help="where llama-server listens")
    parser.add_argument("--llama-server-command", help="start it with this command for the run (stopped after)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--tie", type=float, default=0.1, help="nats: a margin under this is a near-tie")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--out", type=Path, default=Path("results/agreement.json"))
    args = parser.parse_args(argv)
    if httpx.URL(args.llama_server).host not in ("127.0.0.1", "localhost", "::1"):
        parser.error("--llama-server must be on this host (127.0.0.1)")
    from pdserve import LLM, SamplingParams
    from pdserve.models.registry import resolve_model

    model = resolve_model(args.model)
    llm = LLM(model, dtype=args.dtype, quantization=args.quantization)
    server = None
    if args.llama_server_command:
        server = subprocess.Popen(shlex.split(args.llama_server_command.replace("{model}", model)),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_ready(args.llama_server, server)
        rows = []
        for text in PROMPTS:
            ids = llm.engine.tokenizer.encode(text)
            out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
                temperature=0, max_tokens=args.max_tokens, logprobs=2))[0].outputs[0]
            ours = list(out.token_ids)
            our_margins = [e.top[0][1] - e.top[1][1] if len(e.top) > 1 else math.inf for e in out.logprobs]
            theirs, their_margins = _server_greedy(args.llama_server, ids, args.max_tokens)
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            if first is None and len(ours) != len(theirs):  # one stopped (its end-of-generation token) first
                first = min(len(ours), len(theirs))
            row = {"prompt": text, "prompt_tokens": len(ids), "agree": first is None, "first_difference": first}
            if first is not None:
                row |= {"ours_margin": our_margins[first], "llama_cpp_margin": their_margins[first]
                        if first < len(their_margins) else None}
                row["near_tie"] = min(row["ours_margin"], row["llama_cpp_margin"] or math.inf) < args.tie
            rows.append(row)
            print(f"{'=' if first is None else first:>3}  {text[:50]!r}", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    agree = sum(r["agree"] for r in rows)
    ties = sum(bool(r.get("near_tie")) for r in rows if not r["agree"])
    result = {"model": model, "max_tokens": args.max_tokens, "dtype": args.dtype, "tie_nats": args.tie,
              "prompts": len(rows), "agree": agree, "share": agree / len(rows), "differ_at_near_ties": ties,
              "rows": rows}
    print(f"greedy agreement with llama.cpp: {agree}/{len(rows)} prompts identical for {args.max_tokens} tokens "
          f"({100 * agree / len(rows):.0f}%); of the {len(rows) - agree} that differ, {ties} first differ at a "
          f"near-tie (margin < {args.tie} nats on one side); first differences at "
          f"{sorted(r['first_difference'] for r in rows if not r['agree'])}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _wait_ready(url: str, server: subprocess.Popen | None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            raise RuntimeError(f"llama-server exited with {server.returncode} before it was ready")
        try:
            if httpx.get(url.rstrip("/") + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"llama-server at {url} not ready after {timeout:.0f} s")


if __name__ == "__main__":
    raise SystemExit(main())
