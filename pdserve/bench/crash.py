"""`pdserve bench-crash`: what `pdserve serve --durable-kv` gives when a decode worker is SIGKILLed
mid-stream, against the other ways to take it (one cluster per setting, taking turns each round).

- `durable` (1P1D, `--durable-kv`): the worker is restarted, finds its KV pool in shared memory, and
  the router resumes each stream there without computing the prompt again.
- `standby` (1P1D, `--durable-kv --standby`): the same, the restarted worker a spare process whose
  model was loaded (the kill waits for it to be): it only maps the pool and starts serving.
- `migrate` (1P2D, `--migrate-on-failure`): the streams on the killed worker (the one running the
  most, by its /stats) continue on the other, which computes prompt + output again (the streams
  already there are not interrupted).
- `none` (1P1D): the killed worker's streams fail mid-stream.

Each round: `--streams` streaming completions (`openai` client, `ignore_eos`) of `--prompt-tokens`
random token ids; once each has `--kill-after` chunks, SIGKILL a decode worker. Per stream: the
longest gap between chunks from the kill on (`interrupted`: over 5x its median gap before), and
whether it completed. Per round: SIGKILL -> the `ready_again` event (told when `pdserve serve` next
looks, every 0.1 s) and -> the router's log line registering the restarted worker; from each to an
interrupted stream's first chunk after its gap (durable: the resume itself); the router's
`pdserve_migrations_total` by reason. A markdown table per setting (streams pooled over rounds);
the JSON under `--out` holds every round and stream, a PNG plots the gaps, the clusters' logs beside.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from pdserve.bench.local_cluster import stop_serve
from pdserve.workload.args import chosen

SETTINGS = {"durable": ["--prefill", "1", "--decode", "1", "--durable-kv"],
            "standby": ["--prefill", "1", "--decode", "1", "--durable-kv", "--standby"],
            "migrate": ["--prefill", "1", "--decode", "2", "--migrate-on-failure"],
            "none": ["--prefill", "1", "--decode", "1"]}


def _say(message: str) -> None:
    print(f"[bench-crash] {message}", file=sys.stderr, flush=True)


class Cluster:
    """`pdserve serve` as a child process: its stdout events (with the time each arrived) and stderr."""

    def __init__(self, flags: list[str], token: str) -> None:
        from pdserve.credentials import TOKEN_ENV

        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--port", "0",
                                      "--max-restart-backoff", "0.5", *flags], env={**os.environ, TOKEN_ENV: token},
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.events: list[tuple[float, dict]] = []
        self.log: list[tuple[float, str]] = []  # the workers' and the router's log lines too, as they come
        threading.Thread(target=self._read, args=(self.proc.stdout, True), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, False), daemon=True).start()

    def _read(self, pipe, events: bool) -> None:
        for line in pipe:
            t = time.perf_counter()
            if events and line.startswith("{"):
                self.events.append((t, json.loads(line)))
            else:
                self.log.append((t, line))

    def wait(self, kind: str, name: str | None, timeout: float) -> tuple[float, dict] | None:
        """(when it came, the event) of the first `kind` event (of child `name`), waiting up to `timeout`."""
        end = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < end:
            if got := next(((t, e) for t, e in self.events if e["event"] == kind and name in (None, e.get("name"))),
                           None):
                return got
            time.sleep(0.01)
        return None

    def close(self) -> None:
        stop_serve(self.proc)


def token_range(model: str | None) -> tuple[int, int]:
    """Token ids 100..5000, inside the model's vocabulary where its config.json says less."""
    from pdserve.models.registry import resolve_model

    try:
        hi = min(5000, json.loads((Path(resolve_model(model)) / "config.json").read_text())["vocab_size"] - 1)
    except (OSError, ValueError, KeyError, TypeError):  # a GGUF file, say
        hi = 5000
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


def analyse(rec: dict, t_kill: float, t_ready: float | None, t_reg: float | None, max_tokens: int) -> dict:
    """A stream's chunk times to its numbers; `t_ready`/`t_reg` (durable only): when the restarted
    worker was reported ready again, and when the router logged its registration."""
    times = rec.pop("times")
    before = [b - a for a, b in zip(times, times[1:]) if b <= t_kill]
    after = [(b - a, b) for a, b in zip(times, times[1:]) if b > t_kill]
    median = statistics.median(before) if before else None
    gap, resumed_at = max(after) if after else (None, None)
    interrupted = gap is not None and median is not None and gap > 5 * median
    since = lambda t: round((resumed_at - t) * 1e3, 1) if interrupted and t is not None else None  # noqa: E731
    return {**rec, "chunks": len(times), "chunks_before_kill": sum(t <= t_kill for t in times),
            "completed": "error" not in rec and rec.get("tokens", len(times)) == max_tokens,
            "median_gap_ms": median and round(median * 1e3, 2), "gap_ms": gap and round(gap * 1e3, 1),
            "interrupted": interrupted, "ready_to_first_ms": since(t_ready), "registered_to_first_ms": since(t_reg)}


def metric(text: str, reason: str) -> float:
    m = re.search(r'^pdserve_migrations_total\{reason="%s"\} (\S+)$' % reason, text, re.M)
    return float(m.group(1)) if m else 0.0


def one_round(setting: str, args, r: int, lo: int, hi: int, out: Path) -> dict:
    import httpx
    import openai

    from pdserve.credentials import API_KEY_ENV

    flags = SETTINGS[setting] + (["--model", args.model] if args.model else []) + (
        ["--dtype", args.dtype] if args.dtype else [])
    token = secrets.token_hex(32)  # the workers' token: their /stats say which runs the most streams
    c = Cluster(flags, token)
    result: dict = {"setting": setting, "round": r}
    try:
        start = time.perf_counter()
        if (ready := c.wait("ready", None, 600)) is None:
            raise RuntimeError(f"{setting}: the cluster did not start: {''.join(x for _, x in c.log[-15:])}")
        ready = ready[1]
        if setting == "standby" and c.wait("standby", None, 600) is None:
            raise RuntimeError(f"{setting}: no standby came up: {''.join(x for _, x in c.log[-15:])}")
        result["start_s"] = round(time.perf_counter() - start, 1)
        url, model = ready["url"], ready["model"]
        client = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get(API_KEY_ENV) or "none", max_retries=0,
                               timeout=300)
        client.completions.create(model=model, prompt=[lo + 1] * 16, max_tokens=8, temperature=0)  # warm-up
        rng = random.Random(1000 * r + 7)  # distinct prompts, the same every run
        recs = [{"times": []} for _ in range(args.streams)]
        prompts = [rng.choices(range(lo, hi), k=args.prompt_tokens) for _ in recs]
        threads = [threading.Thread(target=stream, args=(client, model, ids, args.max_tokens, rec), daemon=True)
                   for ids, rec in zip(prompts, recs)]
        for t in threads:
            t.start()
        end = time.monotonic() + 300
        while not all(len(x["times"]) >= args.kill_after or "error" in x for x in recs) and time.monotonic() < end:
            time.sleep(0.002)
        running = {p["name"]: httpx.get(p["url"] + "/stats", headers={"Authorization": f"Bearer {token}"},
                                        timeout=10).json()["running"]
                   for p in ready["processes"] if p["name"].startswith("decode worker")}
        victim = next(p for p in ready["processes"] if p["name"] == max(running, key=running.get))
        os.kill(victim["pid"], signal.SIGKILL)
        t_kill = time.perf_counter()
        _say(f"round {r + 1} {setting}: killed {victim['name']} (pid {victim['pid']}; running streams by decode "
             f"worker {running}) at chunks {[len(x['times']) for x in recs]}")
        result["victim"], result["running_at_kill"] = victim["name"], running
        if done := [i for i, x in enumerate(recs) if len(x["times"]) >= args.max_tokens]:
            _say(f"streams {done} had ended before the kill (nothing to interrupt): more --max-tokens helps")
        for t in threads:
            t.join(600)
        again = c.wait("ready_again", victim["name"], 120)
        t_ready = again[0] if again else None
        t_reg = next((t for t, line in c.log if t > t_kill and "registered: decode at" in line), None)
        result["kill_to_ready_again_ms"] = round((t_ready - t_kill) * 1e3, 1) if again else None
        result["kill_to_registered_ms"] = round((t_reg - t_kill) * 1e3, 1) if t_reg else None
        result["load_seconds"] = again[1].get("load_seconds") if again else None
        metrics = httpx.get(url + "/metrics", timeout=30).text
        result["migrations"] = {k: metric(metrics, k) for k in ("resumed", "failure", "hot_spot")}
        durable = setting in ("durable", "standby")
        result["streams"] = [analyse(x, t_kill, t_ready if durable else None, t_reg if durable else None,
                                     args.max_tokens) for x in recs]
    finally:
        c.close()
        (out / f"{setting}-round{r + 1}.log").write_text("".join(line for _, line in c.log))
    return result


def summary(rounds: list[dict]) -> dict:
    streams = [s for x in rounds for s in x["streams"]]
    median = lambda v: statistics.median(v) if v else None  # noqa: E731
    of = lambda key, xs: [x[key] for x in xs if x[key] is not None]  # noqa: E731
    gaps = [s["gap_ms"] for s in streams if s["interrupted"]]
    return {"completed": sum(s["completed"] for s in streams), "streams": len(streams), "interrupted": len(gaps),
            "gap_p50_ms": median(gaps), "gap_max_ms": max(gaps) if gaps else None,
            "kill_to_ready_again_ms": median(of("kill_to_ready_again_ms", rounds)),
            "ready_again_to_first_ms": median(of("ready_to_first_ms", streams)),
            "kill_to_registered_ms": median(of("kill_to_registered_ms", rounds)),
            "registered_to_first_ms": median(of("registered_to_first_ms", streams)),
            "resumed": int(sum(x["migrations"]["resumed"] for x in rounds)),
            "failure_migrations": int(sum(x["migrations"]["failure"] for x in rounds))}


COLUMNS = {"completed / streams": None, "interrupted": "interrupted", "gap after kill p50 (ms)": "gap_p50_ms",
           "gap max (ms)": "gap_max_ms", "kill -> ready_again (ms)": "kill_to_ready_again_ms",
           "ready_again -> first token (ms)": "ready_again_to_first_ms", "kill -> registered (ms)":
           "kill_to_registered_ms", "registered -> first token (ms)": "registered_to_first_ms",
           "resumed": "resumed", "failure migrations": "failure_migrations"}


def table(results: dict) -> str:
    cell = lambda v: "-" if v is None else (f"{v:.0f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| setting | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for name, s in results.items():
        cells = [f"{s['completed']} / {s['streams']}"] + [cell(s[k]) for k in list(COLUMNS.values())[1:]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    from pdserve.workload.plots import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names, xs = list(results), list(range(len(results)))
    for shift, key in ((-0.2, "gap_p50_ms"), (0.2, "gap_max_ms")):
        ax.bar([x + shift for x in xs], [results[n][key] or 0 for n in names], 0.4, label=key[4:7])
    ax.set_xticks(xs, names)
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
    settings = chosen(p, args.settings, SETTINGS)
    if args.rounds < 1 or args.streams < 1 or not 0 < args.kill_after < args.max_tokens - 1:
        p.error("--rounds and --streams must be positive, and --kill-after below --max-tokens")
    from pdserve.bench.machine import environment
    from pdserve.kv_transfer.shm import shm_available

    if {"durable", "standby"} & set(settings) and not shm_available():
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
            errors = sorted({st["error"] for st in x["streams"] if "error" in st})
            _say(f"round {r + 1}/{args.rounds} {s}: completed {sum(st['completed'] for st in x['streams'])}/"
                 f"{len(x['streams'])}, gaps {[st['gap_ms'] for st in x['streams']]} ms, kill -> ready_again "
                 f"{x['kill_to_ready_again_ms']} ms, migrations {x['migrations']}"
                 + (f", errors {errors} (log: {out / f'{s}-round{r + 1}.log'})" if errors else ""))
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
