"""`pdserve serve` as a process: router + 1 prefill + 1 decode worker on the tiny model, a request
through the official client, then SIGTERM stops every child and the command exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai

from tests.serve_process import ServeProcess as Cluster
from tests.wait import wait_for


def test_serve_starts_answers_and_stops(tiny_llama, tmp_path):
    steps = tmp_path / "steps"
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--model", str(tiny_llama), "--port", "0",
           "--dtype", "float32", "--kv-cache-memory", "8MiB", "--pin-cpus", "--record-steps", str(steps),
           "--prefill", "1", "--decode", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()))
        reader.start()
        reader.join(180)
        assert not reader.is_alive(), "no ready line within 180s"
        assert line and line[0], proc.stderr.read() if proc.poll() is not None else "no ready line"
        ready = json.loads(line[0])
        assert ready["event"] == "ready" and ready["workers"] == ["prefill", "decode"]
        assert ready["layout"] == "as the flags ask"
        cores = sorted(os.sched_getaffinity(0))
        for member in ready["processes"]:  # the cluster's token reached every child, but not on its command line
            argv = open(f"/proc/{member['pid']}/cmdline").read().split("\0")
            assert not {"--token", "--api-key"} & set(argv)
            assert b"PDSERVE_TOKEN=" in open(f"/proc/{member['pid']}/environ", "rb").read()
        for member in ready["processes"][1:]:  # each worker runs on its share of the cores
            assert sorted(os.sched_getaffinity(member["pid"])) == member["cpus"]
            assert set(member["cpus"]) <= set(cores) and len(member["cpus"]) == max(1, len(cores) // 2)
        client = openai.OpenAI(base_url=ready["url"] + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model=ready["model"], messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert json.loads(proc.stdout.readline())["event"] == "stopped"
        try:
            httpx.get(ready["url"] + "/health", timeout=2)
            raise AssertionError("the router still answers")
        except httpx.ConnectError:
            pass
        err = proc.stderr.read()
        assert "all 2 workers registered" in err and "stopping" in err
        assert "pdserve.router INFO worker w1 registered" in err  # the router's own log reaches stderr
        # every step each worker ran, with its shape: the prompt (short: the decode worker computes
        # it), then four decodes (the fifth token is the prompt step's)
        logged = {f.name: [json.loads(line) for line in f.read_text().splitlines()] for f in steps.iterdir()}
        assert set(logged) == {"prefill-0.jsonl", "decode-1.jsonl"}
        assert sum(s["prefill_tokens"] for s in logged["decode-1.jsonl"]) == r.usage.prompt_tokens
        assert sum(s["decode_seqs"] for s in logged["decode-1.jsonl"]) == 4
        assert all(s["seconds"] > 0 and 0 <= s["cpu_seconds"] for rows in logged.values() for s in rows)
        starts = [s["at"] for s in logged["decode-1.jsonl"]]  # the wall clock, in step order
        assert starts == sorted(starts) and abs(starts[0] - time.time()) < 600
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_threads_flag_wins_over_the_share_of_cores():
    from argparse import Namespace

    from pdserve.launcher import _threads

    assert _threads(Namespace(threads=1), [0, 1]) == 1
    assert _threads(Namespace(threads=None), [0, 1]) == 2


class Load:
    """Requests one after another from a thread until stopped; each outcome kept with its phase."""

    def __init__(self, url: str, model: str) -> None:
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.model, self.phase, self.outcomes = model, "", []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            phase = self.phase
            try:
                r = self.client.completions.create(model=self.model, prompt="the quick brown fox", max_tokens=8,
                                                   temperature=0, extra_body={"ignore_eos": True})
                self.outcomes.append((phase, r.usage.completion_tokens == 8))
            except openai.OpenAIError:
                self.outcomes.append((phase, False))
                time.sleep(0.2)

    def count(self, phase: str) -> tuple[int, int]:
        """(answered in full, failed) in `phase`."""
        mine = [ok for p, ok in self.outcomes if p == phase]
        return sum(mine), len(mine) - sum(mine)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(90)
        assert not self._thread.is_alive(), "a request hung"


def test_the_cluster_heals_itself(tiny_llama):
    """A drained decode worker (SIGTERM, or the router's admin API) leaves without failing a request
    and comes back; a killed worker and a killed router come back too (the router on its address,
    the workers registering with it again); the command itself stays up throughout and exits 0."""
    admin_key = "admin-" + "k" * 32
    c = Cluster("--model", str(tiny_llama), "--port", "0", "--prefill", "1", "--decode", "2", "--dtype", "float32",
                "--kv-cache-memory", "8MiB", "--max-restart-backoff", "1",
                env={**os.environ, "PDSERVE_ADMIN_KEY": admin_key})
    try:
        wait_for(lambda: c.event("ready") or c.proc.poll() is not None, 240, "the cluster", state=lambda: c.log[-5:])
        ready = c.event("ready")
        assert ready is not None, c.log[-20:]
        url, pids = ready["url"], {p["name"]: p["pid"] for p in ready["processes"]}
        health = lambda: httpx.get(url + "/health", timeout=2).json()  # noqa: E731
        load = Load(url, ready["model"])

        def admin_drain(pid: int) -> None:  # a worker of the first start: its URL is in the ready line
            auth = {"Authorization": f"Bearer {admin_key}"}
            worker_url = next(p["url"] for p in ready["processes"] if p["pid"] == pid)
            workers = httpx.get(url + "/admin/workers", headers=auth).json()["workers"]
            wid = next(w["id"] for w in workers if w["url"] == worker_url)
            assert httpx.post(url + f"/admin/workers/{wid}/drain", headers=auth).status_code == 200

        def phase(name: str, victim: str, act, code: int) -> None:
            load.phase, seen = name, len(c.events)
            wait_for(lambda: load.count(name)[0] >= 2, 60, f"requests before {name}")
            act(pids[victim])
            wait_for(lambda: c.event("restarted", victim, seen), 120, f"{victim} restarted", state=lambda: c.log[-5:])
            assert c.event("exited", victim, seen)["code"] == code
            pids[victim] = c.event("restarted", victim, seen)["pid"]
            wait_for(lambda: _answers(health) and health()["workers"] == 3, 120, f"3 workers after {name}",
                     state=lambda: c.log[-5:])
            done = load.count(name)[0]
            wait_for(lambda: load.count(name)[0] >= done + 2, 60, f"requests after {name}")

        phase("drain", "decode worker 1", lambda pid: os.kill(pid, signal.SIGTERM), 0)
        assert load.count("drain")[1] == 0, c.log[-30:]  # a drain fails no request
        assert any("drained in" in line for line in c.log)
        # ... and the router never sent one to a worker that was gone: it left the registry first
        assert not [line for line in c.log if "decode worker" in line and "failed" in line]
        phase("admin drain", "decode worker 2", admin_drain, 0)
        assert load.count("admin drain")[1] == 0, c.log[-30:]
        phase("kill a worker", "decode worker 2", lambda pid: os.kill(pid, signal.SIGKILL), -signal.SIGKILL)
        phase("kill the router", "router", lambda pid: os.kill(pid, signal.SIGKILL), -signal.SIGKILL)
        load.stop()
        assert c.proc.poll() is None  # nothing a child did ended the command
        assert not c.event("crash_loop")
        c.proc.send_signal(signal.SIGTERM)
        assert c.proc.wait(60) == 0
    finally:
        c.close()


def _answers(health) -> bool:
    try:
        health()
        return True
    except httpx.HTTPError:
        return False
