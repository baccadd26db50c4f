"""`pdserve bench upgrade`: a live cluster moved to a new version under a steady load, through
shadow traffic, then a canary rollout, with no client request failed.

1. Start `pdserve serve` (`--prefill` P, `--decode` D; its workers unlabelled: the stable
   version) and the chaos benchmark's closed-loop load of greedy streamed requests, which runs
   until the end; after `--baseline-s`, start the new version's workers (as many of each role,
   `pdserve worker --version-label v2`, the cluster's token through the environment).
2. Shadow: copy `--shadow-share` of the requests to v2 (at most `--shadow-concurrency` at once)
   for `--shadow-s`; its report says the load it added (copies a second, against the primary's
   requests), the greedy token agreement and its latency against the primary's.
3. Canary: a rollout to v2 in `--steps`, each at least `--step-s`; wait for its promotion (or
   its rollback, which fails the run), then `--tail-s` more of load on v2 alone.
4. Stop the load, audit every request (ok / error / lost, as the chaos benchmark judges them:
   the goal is none but ok), check the old version's workers went idle, stop everything. Report:
   JSON and a markdown summary, per phase the throughput and TTFT the clients saw.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from pdserve.bench.chaos.cluster import ChaosCluster
from pdserve.bench.chaos.load import ClosedLoopLoad, RequestResult
from pdserve.bench.chaos.report import outcome_counts
from pdserve.credentials import TOKEN_ENV
from pdserve.workload.loadgen import LengthDist, WorkloadSpec, build_requests
from pdserve.workload.results import write_json

say = lambda msg: print(f"[bench upgrade] {msg}", file=sys.stderr, flush=True)  # noqa: E731
NEW = "v2"
POOL = 512  # distinct seeded requests the load cycles through


class Upgrade:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.marks: dict[str, float] = {}  # phase -> when it began (monotonic)
        self.new_workers: list[subprocess.Popen] = []

    def run(self) -> dict:
        a = self.args
        log = Path(a.server_log_dir) / "bench_upgrade_server.log"
        say(f"starting the cluster ({a.model}, {a.prefill}P{a.decode}D); its log: {log}")
        cluster = ChaosCluster(a.model, ["--prefill", str(a.prefill), "--decode", str(a.decode),
                                         *shlex.split(a.engine_args)], log)
        self.cluster, self.admin = cluster, httpx.Client(
            base_url=cluster.url, timeout=30, headers={"Authorization": f"Bearer {cluster.admin_key}"})
        load = None
        try:
            info = httpx.get(cluster.url + "/v1/models", timeout=30).json()["data"][0]
            spec = WorkloadSpec(POOL, a.input_len, a.output_len, a.seed, int(info.get("vocab_size") or 256))
            load = ClosedLoopLoad(cluster.url, info["id"], build_requests(spec), a.concurrency, a.request_timeout)
            runner = threading.Thread(target=load.run, daemon=True, name="upgrade-load")
            runner.start()
            result = self._phases(load)
            load.stop.set()
            runner.join(a.request_timeout + 30)
            result["old_version_idle"] = self._old_idle()
        finally:
            if load is not None:
                load.stop.set()
            self._stop_new_workers()
            cluster.stop()
        return self._report(result, load)

    def _phases(self, load: ClosedLoopLoad) -> dict:
        a = self.args
        self._mark("baseline")
        time.sleep(a.baseline_s)
        self._mark("new workers")
        self._start_new_workers()
        self._mark("shadow")
        shadow = self._post("/admin/shadow", {"version": NEW, "share": a.shadow_share,
                                              "max_concurrency": a.shadow_concurrency})
        time.sleep(a.shadow_s)
        shadow = self._post("/admin/shadow/stop")
        self._mark("canary")
        self._post("/admin/rollout", {"canary": NEW, "steps": a.steps, "step_s": a.step_s,
                                      "min_requests": a.min_requests})
        while (status := self.admin.get("/admin/rollout").json())["state"] == "running":
            say(f"canary at {status['share']:.0%}, step {status['step_age_s']:.0f}s old, {load.counts()}")
            time.sleep(1.0)
        self._mark("promoted" if status["state"] == "promoted" else status["state"])
        say(f"rollout {status['state']}: {status['events'][-1]}")
        time.sleep(a.tail_s)
        self._mark("end")
        return {"shadow": shadow, "rollout": status}

    def _mark(self, phase: str) -> None:
        self.marks[phase] = time.monotonic()
        say(f"{phase} at {self.marks[phase] - self.marks.get('baseline', self.marks[phase]):.1f}s")

    def _post(self, path: str, body: dict | None = None) -> dict:
        r = self.admin.post(path, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"POST {path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def _start_new_workers(self) -> None:
        a = self.args
        env = {**os.environ, TOKEN_ENV: self.cluster.token}
        roles = ["prefill"] * a.prefill + ["decode"] * a.decode
        for role in roles:
            argv = [sys.executable, "-m", "pdserve.cli", "worker", "--role", role, "--version-label", NEW,
                    "--router", self.cluster.url, "--port", "0", "--transfer", "tcp", "--threads", "1",
                    "--model", a.model, *shlex.split(a.engine_args)]
            self.new_workers.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                                     stderr=open(Path(a.server_log_dir) / f"bench_upgrade_{NEW}.log",
                                                                 "a")))
        deadline = time.monotonic() + a.start_timeout
        while sum(w["version"] == NEW for w in self.admin.get("/admin/workers").json()["workers"]) < len(roles):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.new_workers):
                raise RuntimeError(f"the {NEW} workers did not all register (see bench_upgrade_{NEW}.log)")
            time.sleep(0.5)

    def _old_idle(self) -> bool:
        workers = self.admin.get("/admin/workers").json()["workers"]
        return all(w["running"] == 0 and w["queued"] == 0 for w in workers if w["version"] != NEW)

    def _stop_new_workers(self) -> None:
        for p in self.new_workers:
            p.terminate()
        for p in self.new_workers:
            try:
                p.wait(timeout=90)
            except subprocess.TimeoutExpired:
                p.kill()

    def _report(self, result: dict, load: ClosedLoopLoad | None) -> dict:
        results: list[RequestResult] = sorted(load.results, key=lambda r: r.start) if load else []
        order = list(self.marks)
        phases = []
        for name, nxt in zip(order, order[1:]):
            begin, end = self.marks[name], self.marks[nxt]
            done = [r for r in results if r.end is not None and begin <= r.end < end]
            ttft = [r.first_token - r.start for r in done if r.outcome == "ok" and r.first_token is not None]
            phases.append({"phase": name, "seconds": round(end - begin, 1),
                           "requests_per_s": round(sum(r.outcome == "ok" for r in done) / (end - begin), 3),
                           "ttft_median_s": round(statistics.median(ttft), 4) if ttft else None,
                           **outcome_counts(done)})
        shadow, rollout = result["shadow"], result["rollout"]
        shadow_s = self.marks["canary"] - self.marks["shadow"]
        primary = next(p for p in phases if p["phase"] == "shadow")["requests_per_s"]
        shadow_load = {"copies_per_s": round(shadow["mirrored"] / shadow_s, 3),
                       "share_of_primary_requests": round(shadow["mirrored"] / shadow_s / primary, 3) if primary else None,
                       "skipped_busy": shadow["skipped_busy"], "greedy_agreement_mean": shadow["greedy_agreement_mean"],
                       "latency_medians": shadow["latency_medians"]}
        promoted = rollout["state"] == "promoted"
        return {"outcomes": outcome_counts(results), "promoted": promoted,
                "time_to_promote_s": round(self.marks[order[-2]] - self.marks["canary"], 1) if promoted else None,
                "rollout_events": rollout["events"], "shadow_load": shadow_load, "phases": phases,
                "old_version_idle": result["old_version_idle"], "args": _jsonable(vars(self.args))}


def _jsonable(args: dict) -> dict:
    return {k: str(v) if isinstance(v, LengthDist) else v for k, v in args.items()}


def markdown(report: dict) -> str:
    o = report["outcomes"]
    shadow = report["shadow_load"]
    lines = [f"requests: {o['ok']} ok, {o['error']} failed, {o['lost']} lost; "
             f"{'promoted in ' + str(report['time_to_promote_s']) + ' s' if report['promoted'] else 'NOT promoted'}; "
             f"old version idle after: {report['old_version_idle']}",
             f"shadow: {shadow['copies_per_s']} copies/s ({shadow['share_of_primary_requests']} of the primary's "
             f"requests), {shadow['skipped_busy']} skipped at its bound, greedy agreement "
             f"{shadow['greedy_agreement_mean']}", "",
             "| phase | s | requests/s | TTFT median (s) | ok | error | lost |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {p['phase']} | {p['seconds']} | {p['requests_per_s']} | {p['ttft_median_s']} | {p['ok']} | "
              f"{p['error']} | {p['lost']} |" for p in report["phases"]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench upgrade", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="the model both versions serve (default: as `pdserve serve`)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers of each version")
    p.add_argument("--decode", type=int, default=2, help="decode workers of each version")
    p.add_argument("--engine-args", default="", help="engine flags for every worker, e.g. '--dtype float32'")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input-len", default="320")
    p.add_argument("--output-len", default="32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline-s", type=float, default=20.0)
    p.add_argument("--shadow-s", type=float, default=30.0)
    p.add_argument("--shadow-share", type=float, default=0.25)
    p.add_argument("--shadow-concurrency", type=int, default=2)
    p.add_argument("--steps", default="0.1,0.5,1.0", help="the canary's shares, comma-separated, ending at 1.0")
    p.add_argument("--step-s", type=float, default=10.0)
    p.add_argument("--min-requests", type=int, default=10, help="canary requests a step needs")
    p.add_argument("--tail-s", type=float, default=10.0, help="load on the new version alone after its promotion")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds the new workers get to register")
    p.add_argument("--result-json", default="results/bench_upgrade.json")
    p.add_argument("--server-log-dir", default="results")
    args = p.parse_args(argv)
    try:
        args.input_len, args.output_len = LengthDist.parse(args.input_len), LengthDist.parse(args.output_len)
        args.steps = [float(s) for s in args.steps.split(",")]
    except ValueError as e:
        p.error(str(e))
    if args.prefill < 0 or args.decode < 1 or args.concurrency < 1 or not 0 < args.shadow_share <= 1:
        p.error("--decode and --concurrency must be >= 1, --prefill >= 0, --shadow-share in (0, 1]")
    if min(args.baseline_s, args.shadow_s, args.step_s, args.tail_s, args.request_timeout) <= 0:
        p.error("every duration must be > 0")
    Path(args.server_log_dir).mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = Upgrade(args).run()
    except (RuntimeError, httpx.HTTPError) as e:
        say(f"{type(e).__name__}: {e}")
        return 1
    write_json(args.result_json, report)
    print(markdown(report))
    say(f"written: {args.result_json}")
    o = report["outcomes"]
    return 0 if report["promoted"] and o["error"] == o["lost"] == 0 else 1
