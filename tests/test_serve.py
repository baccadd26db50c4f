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


def test_serve_starts_answers_and_stops(tiny_llama, tmp_path):
    steps = tmp_path / "steps"
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--model", str(tiny_llama), "--port", "0",
           "--dtype", "float32", "--kv-cache-memory", "8MiB", "--pin-cpus", "--record-steps", str(steps)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()))
        reader.start()
        reader.join(180)
        assert line and line[0], proc.stderr.read() if proc.poll() is not None else "no ready line"
        ready = json.loads(line[0])
        assert ready["event"] == "ready" and ready["workers"] == ["prefill", "decode"]
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
