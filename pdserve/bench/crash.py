"""`pdserve bench-crash`: what `pdserve serve --durable-kv` gives when a decode worker is SIGKILLed
mid-stream, against the other ways a cluster can take it (one cluster per setting, taking turns
each round).

- `durable`: 1 prefill + 1 decode worker with `--durable-kv`: the worker is restarted, finds its KV
  pool in shared memory, and the router resumes each stream there without computing the prompt again.
- `migrate`: 1 prefill + 2 decode workers with `--migrate-on-failure`: the killed worker's streams
  continue on the other one, which computes prompt + output so far again (`decode worker 1` is
  killed; the streams the router put on the other one are not interrupted).
- `none`: 1 prefill + 1 decode worker, neither: the killed worker's streams fail mid-stream.

Each round: `--streams` concurrent streaming completions (the `openai` client, `ignore_eos`) of
`--prompt-tokens` random token ids each; once every stream has `--kill-after` chunks, SIGKILL
`decode worker 1`. Per stream: the longest gap between chunks from the kill on (a stream is
`interrupted` where it is over 5x its median gap before the kill), whether it completed all
`--max-tokens` without error. Per round: SIGKILL -> the restarted worker's `ready_again` event, and
(durable) `ready_again` -> each interrupted stream's first chunk after the gap (the resume itself),
and the router's `pdserve_migrations_total` by reason. Printed as a markdown table per setting
(streams pooled over rounds); the JSON under `--out` holds every round and stream, a PNG plots the
gaps, and each cluster's log is kept beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

SETTINGS = {"durable": ["--prefill", "1", "--decode", "1", "--durable-kv"],
            "migrate": ["--prefill", "1", "--decode", "2", "--migrate-on-failure"],
            "none": ["--prefill", "1", "--decode", "1"]}
VICTIM = "decode worker 1"


def _say(message: str) -> None:
    print(f"[bench-crash] {message}", file=sys.stderr, flush=True)


class Cluster:
    """`pdserve serve` as a child process: its stdout events (with the time each arrived) and stderr."""

    def __init__(self, flags: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--port", "0",
                                      "--max-restart-backoff", "0.5", *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.events: list[tuple[float, dict]] = []
        self.log: list[str] = []
        threading.Thread(target=self._read_events, daemon=True).start()
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()

    def _read_events(self) -> None:
        for line in self.proc.stdout:
            try:
                self.events.append((time.perf_counter(), json.loads(line)))
            except ValueError:
                self.log.append(line)

    def event(self, kind: str, name: str | None = None) -> tuple[float, dict] | None:
        return next(((t, e) for t, e in self.events if e["event"] == kind and name in (None, e.get("name"))), None)

    def wait(self, kind: str, name: str | None, timeout: float) -> tuple[float, dict] | None:
        end = time.monotonic() + timeout
        while (got := self.event(kind, name)) is None and self.proc.poll() is None and time.monotonic() < end:
            time.sleep(0.01)
        return got

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # it stops its children
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # its children get SIGTERM from the kernel (PR_SET_PDEATHSIG)
                self.proc.wait(10)


def token_range(model: str | None) -> tuple[int, int]:
    """Token ids 100..5000, inside the model's vocabulary where its config.json says less."""
    try:
        from pdserve.models.registry import resolve_model

        vocab = json.loads((Path(resolve_model(model)) / "config.json").read_text())["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return 100, 5000
    hi = min(5000, vocab - 1)
    return min(100, hi // 2), hi


def stream(client, model: str, ids: list[int], max_tokens: int, rec: dict) -> None:
    try:
        for chunk in client.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}):
            if chunk.choices:
                rec["times"].append(time.perf_counter())
            if chunk.usage:
                rec["tokens"] = chunk.usage.completion_tokens
    except Exception as e:  # a failed stream is a result here
        rec["error"] = f"{type(e).__name__}: {e}"[:400]


def analyse(rec: dict, t_kill: float, t_ready: float | None, max_tokens: int) -> dict:
    times = rec.pop("times")
    before = [b - a for a, b in zip(times, times[1:]) if b <= t_kill]
    after = [(b - a, b) for a, b in zip(times, times[1:]) if b > t_kill]
    median = statistics.median(before) if before else None
    gap, resumed_at = max(after) if after else (None, None)
    interrupted = gap is not None and median is not None and gap > 5 * median
    return {**rec, "chunks": len(times), "chunks_before_kill": sum(t <= t_kill for t in times),
            "completed": "error" not in rec and rec.get("tokens", len(times)) == max_tokens,
            "median_gap_ms": median and round(median * 1e3, 2), "gap_ms": gap and round(gap * 1e3, 1),
            "interrupted": interrupted,
            "ready_to_first_ms": (round((resumed_at - t_ready) * 1e3, 1)
                                  if interrupted and t_ready is not None else None)}


def metric(text: str, reason: str) -> float:
    m = re.search(r'^pdserve_migrations_total\{reason="%s"\} (\S+)$' % reason, text, re.M)
    return float(m.group(1)) if m else 0.0


def one_round(setting: str, args, r: int, lo: int, hi: int, out: Path) -> dict:
    import httpx
    import openai

    from pdserve.credentials import API_KEY_ENV

    flags = SETTINGS[setting] + (["--model", args.model] if args.model else []) + (
        ["--dtype", args.dtype] if args.dtype else [])
    c = Cluster(flags)
    result: dict = {"setting": setting, "round": r}
    try:
        start = time.perf_counter()
        ready = c.wait("ready", None, 600)
        if ready is None:
            raise RuntimeError(f"{setting}: the cluster did not start: {''.join(c.log[-15:])}")
        ready = ready[1]
        result["start_s"] = round(time.perf_counter() - start, 1)
        url, model = ready["url"], ready["model"]
        victim = next(p for p in ready["processes"] if p["name"] == VICTIM)
        client = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get(API_KEY_ENV) or "none", max_retries=0,
                               timeout=300)
        client.completions.create(model=model, prompt=[lo + 1] * 16, max_tokens=8, temperature=0)  # warm-up
        rng = random.Random(1000 * r + 7)
        recs = [{"times": []} for _ in range(args.streams)]
        threads = [threading.Thread(target=stream, args=(client, model, [rng.randint(lo, hi) for _ in
                                                                         range(args.prompt_tokens)],
                                                         args.max_tokens, rec), daemon=True) for rec in recs]
        for t in threads:
            t.start()
        end = time.monotonic() + 300
        while not all(len(x["times"]) >= args.kill_after or "error" in x for x in recs) and time.monotonic() < end:
            time.sleep(0.002)
        os.kill(victim["pid"], signal.SIGKILL)
        t_kill = time.perf_counter()
        _say(f"round {r + 1} {setting}: killed {VICTIM} (pid {victim['pid']}) at chunks "
             f"{[len(x['times']) for x in recs]}")
        for t in threads:
            t.join(600)
        again = c.wait("ready_again", VICTIM, 120)
        t_ready = again[0] if again else None
        result["kill_to_ready_again_ms"] = round((t_ready - t_kill) * 1e3, 1) if again else None
        result["load_seconds"] = again[1].get("load_seconds") if again else None
        metrics = httpx.get(url + "/metrics", timeout=30).text
        result["migrations"] = {k: metric(metrics, k) for k in ("resumed", "failure", "hot_spot")}
        result["streams"] = [analyse(x, t_kill, t_ready if setting == "durable" else None, args.max_tokens)
                             for x in recs]
    finally:
        c.close()
        (out / f"{setting}-round{r + 1}.log").write_text("".join(c.log))
    return result


def summary(rounds: list[dict]) -> dict:
    streams = [s for x in rounds for s in x["streams"]]
    gaps = [s["gap_ms"] for s in streams if s["interrupted"]]
    resumes = [s["ready_to_first_ms"] for s in streams if s["ready_to_first_ms"] is not None]
    ready = [x["kill_to_ready_again_ms"] for x in rounds if x["kill_to_ready_again_ms"] is not None]
    return {"completed": sum(s["completed"] for s in streams), "streams": len(streams),
            "interrupted": len(gaps), "gap_p50_ms": statistics.median(gaps) if gaps else None,
            "gap_max_ms": max(gaps) if gaps else None,
            "kill_to_ready_again_ms": statistics.median(ready) if ready else None,
            "ready_again_to_first_ms": statistics.median(resumes) if resumes else None,
            "resumed": sum(x["migrations"]["resumed"] for x in rounds),
            "failure_migrations": sum(x["migrations"]["failure"] for x in rounds)}


def table(results: dict) -> str:
    cell = lambda v: "-" if v is None else (f"{v:.0f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| setting | completed / streams | interrupted | gap after kill p50 (ms) | gap max (ms) | "
             "kill -> ready_again (ms) | ready_again -> first token (ms) | resumed | failure migrations |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in results.items():
        lines.append(f"| {name} | {s['completed']} / {s['streams']} | {s['interrupted']} | {cell(s['gap_p50_ms'])} | "
                     f"{cell(s['gap_max_ms'])} | {cell(s['kill_to_ready_again_ms'])} | "
                     f"{cell(s['ready_again_to_first_ms'])} | {cell(int(s['resumed']))} | "
                     f"{cell(int(s['failure_migrations']))} |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    from pdserve.workload.plots import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(results)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [results[n]["gap_p50_ms"] or 0 for n in names], 0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], [results[n]["gap_max_ms"] or 0 for n in names], 0.4, label="max")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("gap after the kill (ms), interrupted streams")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    return save_figure(plt, fig, "a decode worker SIGKILLed mid-stream", path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench-crash", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--dtype", default=None, help="default: the workers' default")
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--kill-after", type=int, default=32, help="chunks every stream has before the kill")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="bench-crash-results", help="folder for the JSON, the PNG and the logs")
    args = p.parse_args(argv)
    settings = args.settings.split(",")
    if unknown := [s for s in settings if s not in SETTINGS]:
        p.error(f"unknown setting(s) {unknown}: choose from {', '.join(SETTINGS)}")
    if args.rounds < 1 or args.streams < 1 or not 0 < args.kill_after < args.max_tokens - 1:
        p.error("--rounds and --streams must be positive, and --kill-after below --max-tokens")
    from pdserve.bench.machine import environment
    from pdserve.kv_transfer.shm import shm_available

    if "durable" in settings and not shm_available():
        p.error("durable needs a writable /dev/shm")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = environment()
    _say(f"CPU: {machine['cpu']} ({machine['cpu_count']} cores)")
    lo, hi = token_range(args.model)
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for s in settings:
            x = one_round(s, args, r, lo, hi, out)
            runs[s].append(x)
            for i, st in enumerate(x["streams"]):
                if s == "durable" and not st["completed"]:
                    _say(f"round {r + 1} durable: stream {i} did not complete: {st.get('error')}; "
                         f"see {out / f'durable-round{r + 1}.log'}")
            _say(f"round {r + 1}/{args.rounds} {s}: completed {sum(st['completed'] for st in x['streams'])}/"
                 f"{len(x['streams'])}, gaps {[st['gap_ms'] for st in x['streams']]} ms, kill -> ready_again "
                 f"{x['kill_to_ready_again_ms']} ms, migrations {x['migrations']}")
    results = {s: summary(rs) for s, rs in runs.items()}
    path = out / "bench_crash.json"
    path.write_text(json.dumps({"machine": machine, "settings": vars(args), "results": results, "runs": runs},
                               indent=2))
    try:
        png = plot(results, path.with_suffix(".png"))
        _say(f"wrote {path} and {png}")
    except ImportError:
        _say(f"wrote {path} (no matplotlib: no plot)")
    print(f"CPU: {machine['cpu']} ({machine['cpu_count']} cores); {args.streams} streams x {args.rounds} rounds, "
          f"{args.prompt_tokens}-token prompts, {args.max_tokens} tokens each, kill after {args.kill_after}\n")
    print(table(results))
    return 0
