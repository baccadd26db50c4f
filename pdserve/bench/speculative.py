"""`pdserve bench-speculative`: what speculative decoding gains on this machine, in one run.

Each method (`--methods`, `off` first: the baseline) gets an engine of its own, warmed up; each
workload is then answered at each stream count by every engine in turn, `--rounds` times. A
stream count of N keeps N requests live: a request that ends is replaced by the workload's next
prompt, as clients that send again would (so the batch does not thin out at its end as a fixed
batch would). Greedy decoding, `--max-tokens` tokens at most.

Workloads, on the model's chat template:
- `rewrite`: copy a paragraph out clean, or tidy its wording: the output repeats the input;
- `code-fix`: return a short function with its bug fixed: mostly the input again;
- `chat`: open-ended questions and stories: little of the output repeats anything.

Reported per workload, stream count and method (medians over the rounds): output tokens a second
(all requests, their prompts included), decode tokens a second of a request (1 / its time per
output token), the speed-up of both against `off`, the share of draft tokens kept and the tokens a
verified draft gives on average; the JSON holds it all, and a PNG plots the speed-ups.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from pdserve.bench.machine import environment
from pdserve.workload.results import write_json

PARAGRAPHS = [
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the members "
    "agreed to increase funding for the library and the public parks, while reducing spending on new office "
    "furniture. The chair thanked everyone for their patience and asked the secretary to circulate the minutes.",
    "Our bakery opens at seven every morning except Sunday. Fresh bread comes out of the oven at eight, and the "
    "cinnamon rolls are usually gone by ten. We take orders for birthday cakes at least three days in advance, "
    "and we are happy to write a short message on top in icing.",
    "To reset the router, hold the small button on the back for ten seconds until the lights blink. Wait two "
    "minutes for it to start again, then connect to the network printed on the label. If the lights stay red, "
    "unplug the power cable, wait thirty seconds, and plug it back in.",
    "The river rose quickly after three days of heavy rain. Farmers moved their animals to higher ground, and the "
    "town closed the old bridge as a precaution. By Friday the water had started to fall, and volunteers began "
    "clearing mud from the streets near the market square.",
]
REWRITE_ASKS = ["Copy this text exactly, word for word:", "Rewrite this text with correct punctuation, changing "
                "nothing else:"]
SNIPPETS = [
    "def average(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(value)\n",
    "def is_even(n):\n    if n % 2 == 1:\n        return True\n    return False\n",
    "def largest(items):\n    best = items[0]\n    for item in items:\n        if item < best:\n            best = item\n"
    "    return best\n",
    "def count_words(text):\n    words = text.split(',')\n    return len(words)\n",
]
QUESTIONS = [
    "Write a short story about a dragon who learns to cook.", "Explain how a bicycle works to a child.",
    "What are three good habits for staying healthy? Explain each.", "Write a poem about the sea in winter.",
    "Describe a day in the life of a lighthouse keeper.", "Why is the sky blue? Answer in a few sentences.",
    "Give advice to someone starting their first job.", "Write a short story about a robot who plants a garden.",
]


def conversations() -> dict[str, list[list[dict]]]:
    """Each workload's prompts, as chat messages."""
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    return {
        "rewrite": [user(f"{ask}\n\n{p}") for p in PARAGRAPHS for ask in REWRITE_ASKS],
        "code-fix": [user(f"Fix the bug in this Python function and return the whole corrected function:\n\n{s}")
                     for s in SNIPPETS],
        "chat": [user(q) for q in QUESTIONS],
    }


def _say(message: str) -> None:
    print(f"[bench-speculative] {message}", file=sys.stderr, flush=True)


def encode(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation on the model's chat template; a model without one gets its text plainly."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, True, tokenize=True)
    return tokenizer.encode("\n".join(m["content"] for m in messages) + "\n")


def run_streams(engine, prompts: list[list[int]], streams: int, requests: int, max_tokens: int) -> dict:
    """`requests` prompts (the list, round and round) answered with `streams` of them live at a
    time: output tokens a second over the run, each request's decode tokens a second, and the
    drafts verified meanwhile."""
    from pdserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    sched = engine.scheduler
    if sched.proposer is not None:
        sched.proposer.forget()  # each run learns from its own requests only
    before = (sched.num_drafts, sched.num_drafted, sched.num_accepted)
    live, done, sent = [], [], 0
    start = time.perf_counter()
    while sent < requests or live:
        while sent < requests and len(live) < streams:
            rid = engine.add_request(None, {"prompt_token_ids": prompts[sent % len(prompts)]}, params)
            live.append((sent, sched.requests[rid]))
            sent += 1
        engine.step()
        done += [(i, r) for i, r in live if r.status.finished]
        live = [(i, r) for i, r in live if not r.status.finished]
    seconds = time.perf_counter() - start
    done = [r for _, r in sorted(done, key=lambda item: item[0])]  # in the order they were sent
    outputs = [r.output_token_ids for r in done]
    decode = [(len(r.output_token_ids) - 1) / (r.finished_time - r.first_token_time)
              for r in done if len(r.output_token_ids) > 1 and r.finished_time > r.first_token_time]
    drafts, drafted, accepted = (now - then for now, then in
                                 zip((sched.num_drafts, sched.num_drafted, sched.num_accepted), before))
    return {"output_tok_s": sum(map(len, outputs)) / seconds, "decode_tok_s": statistics.mean(decode) if decode else 0.0,
            "outputs": outputs, "drafts": drafts, "draft_tokens": drafted, "draft_tokens_accepted": accepted}


def summarize(runs: list[dict], baseline: list[dict] | None) -> dict:
    """Medians over a cell's rounds, its speed-ups against the baseline's, and its acceptance."""
    out = {key: round(statistics.median(r[key] for r in runs), 2) for key in ("output_tok_s", "decode_tok_s")}
    drafts, drafted, accepted = (sum(r[k] for r in runs) for k in ("drafts", "draft_tokens", "draft_tokens_accepted"))
    out.update(drafts=drafts, draft_tokens=drafted, draft_tokens_accepted=accepted,
               acceptance=round(accepted / drafted, 3) if drafted else None,
               mean_accepted_length=round(1 + accepted / drafts, 2) if drafts else None)
    if baseline is not None:
        for key in ("output_tok_s", "decode_tok_s"):
            base = statistics.median(r[key] for r in baseline)
            out[f"{key.removesuffix('_tok_s')}_speedup"] = round(out[key] / base, 3) if base else None
        same = sum(a["outputs"] == b["outputs"] for a, b in zip(runs, baseline))
        out["rounds_with_the_baselines_tokens"] = f"{same} of {len(runs)}"
    return out


def plot(results: dict, methods: list[str], path: Path) -> Path:
    """Decode and throughput speed-ups against `off`, a bar per workload and stream count."""
    from pdserve.workload.plots import pyplot, save_figure

    plt = pyplot()
    cells = [(w, s) for w, by_streams in results.items() for s in by_streams]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    width = 0.8 / max(1, len(methods) - 1)
    for ax, key, name in zip(axes, ("decode_speedup", "output_speedup"), ("a request's decode speed", "throughput")):
        for j, method in enumerate(methods[1:]):
            values = [results[w][s][method].get(key) or 0 for w, s in cells]
            ax.bar([i + j * width for i in range(len(cells))], values, width, label=method)
        ax.axhline(1.0, color="grey", linewidth=1)
        ax.set_xticks([i + width * (len(methods) - 2) / 2 for i in range(len(cells))],
                      [f"{w}\n{s} stream{'s' if int(s) > 1 else ''}" for w, s in cells], fontsize=8)
        ax.set_title(f"{name}: speed-up against no speculation")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend()
    return save_figure(plt, fig, "speculative decoding", path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench-speculative", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--methods", default="off,ngram,suffix", help="comma-separated, off first (the baseline)")
    p.add_argument("--num-speculative-tokens", type=int, default=8)
    p.add_argument("--streams", default="1,8", help="comma-separated stream counts")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per stream count and round (default: 3 for one stream, 2 per stream above)")
    p.add_argument("--workloads", default="rewrite,code-fix,chat")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--result-json", default="results/bench_speculative.json")
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    workloads = args.workloads.split(",")
    known = conversations()
    try:
        streams = [int(s) for s in args.streams.split(",")]
    except ValueError:
        p.error(f"--streams takes comma-separated integers, got {args.streams!r}")
    if methods[0] != "off" or len(methods) < 2 or len(set(methods)) != len(methods):
        p.error("--methods must start with off (the baseline) and name at least one method once")
    if unknown := [w for w in workloads if w not in known]:
        p.error(f"unknown workload(s) {unknown}: choose from {sorted(known)}")
    if min(streams + [args.max_tokens, args.rounds]) < 1 or args.requests < 0:
        p.error("--streams, --max-tokens and --rounds must be positive, --requests not negative")

    from pdserve import LLM
    from pdserve.models.registry import resolve_model

    model = resolve_model(args.model)
    engines = {}
    for method in methods:
        llm = LLM(model, dtype=args.dtype, kv_cache_memory="512MiB", speculative=method,
                  num_speculative_tokens=args.num_speculative_tokens)
        _say(f"{method}: warm-up {llm.engine.warm_up():.1f} s")
        engines[method] = llm.engine
    tokenizer = engines["off"].tokenizer
    prompts = {w: [encode(tokenizer, c) for c in known[w]] for w in workloads}
    runs: dict[tuple[str, int, str], list[dict]] = {}
    for r in range(args.rounds):
        for w in workloads:
            for s in streams:
                count = args.requests or (3 if s == 1 else 2 * s)
                line = []
                for method, engine in engines.items():
                    run = run_streams(engine, prompts[w], s, count, args.max_tokens)
                    runs.setdefault((w, s, method), []).append(run)
                    line.append(f"{method} {run['output_tok_s']:.1f} tok/s (a request decodes {run['decode_tok_s']:.1f})")
                _say(f"round {r + 1}/{args.rounds} {w}, {s} stream(s), {count} requests: " + "; ".join(line))
    results = {w: {str(s): {m: summarize(runs[w, s, m], None if m == "off" else runs[w, s, "off"]) for m in methods}
                   for s in streams} for w in workloads}
    for w, by_streams in results.items():
        for s, by_method in by_streams.items():
            for m, cell in list(by_method.items())[1:]:
                _say(f"{w}, {s} stream(s), {m}: decode x{cell['decode_speedup']}, throughput x{cell['output_speedup']}, "
                     f"{cell['acceptance']} of draft tokens kept, {cell['mean_accepted_length']} tokens a draft")
    result = {"model": args.model or "default", "dtype": str(engines["off"].dtype).removeprefix("torch."),
              "methods": methods, "num_speculative_tokens": args.num_speculative_tokens,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "environment": environment(), "results": results}
    path = write_json(args.result_json, result)
    print(json.dumps(result, indent=2))
    _say(f"wrote {path} and {plot(results, methods, Path(path).with_suffix('.png'))}")
    return 0
