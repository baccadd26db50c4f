"""`pdserve serve` with a prefill pool of two tensor-parallel ranks and a decode pool of one
(`--prefill-engine-args`): answers through the official `openai` client equal one process's, the
KV crossing between the splits; the ranks are one worker to the supervisor: a SIGKILLed worker's
other rank goes with it and the worker comes back whole, and one sent SIGTERM (a rolling restart)
drains, stops its other rank and comes back whole too."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import psutil

from pdserve import LLM, SamplingParams
from pdserve.credentials import TOKEN_ENV
from tests.serve_process import ServeProcess
from tests.wait import wait_for
from tests.worker.cluster import prompt

TOKEN = "t" * 48


def test_a_cluster_of_split_prefill_and_whole_decode_answers_like_one_process(tiny_llama):
    c = ServeProcess("--model", str(tiny_llama), "--port", "0", "--prefill", "1", "--decode", "1", "--dtype", "float32",
                     "--block-size", "4", "--kv-cache-memory", "8MiB", "--max-restart-backoff", "0.5",
                     "--prefill-engine-args", "--tensor-parallel-size 2", env={**os.environ, TOKEN_ENV: TOKEN})
    try:
        wait_for(lambda: c.event("ready") or c.proc.poll() is not None, 240, "the cluster", state=lambda: c.log[-5:])
        ready = c.event("ready")
        assert ready is not None, c.log[-20:]
        client = openai.OpenAI(base_url=ready["url"] + "/v1", api_key="none", max_retries=0, timeout=120)
        llm = LLM(str(tiny_llama), dtype="float32", block_size=4)
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        prompts = [prompt(n, seed=n) for n in (260, 300, 333)]  # past the router's 256: prefilled remotely
        for p in prompts:
            r = client.completions.create(model=ready["model"], prompt=p, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == llm.generate([{"prompt_token_ids": p}], greedy)[0].outputs[0].text
        decode = next(p for p in ready["processes"] if p["name"].startswith("decode"))
        stats = httpx.get(decode["url"] + "/stats", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert stats["kv_landed"] == len(prompts) and stats["kv_recomputed"] == 0, stats
        prefill = next(p for p in ready["processes"] if p["name"].startswith("prefill"))
        ranks = psutil.Process(prefill["pid"]).children()
        assert len(ranks) == 1 and "pdserve.engine.parallel.follower" in " ".join(ranks[0].cmdline())
        os.kill(prefill["pid"], signal.SIGKILL)
        wait_for(lambda: not ranks[0].is_running() or ranks[0].status() == psutil.STATUS_ZOMBIE, 30,
                 "the killed worker's other rank to exit")
        wait_for(lambda: c.event("ready_again"), 120, "the worker started again", state=lambda: c.log[-5:])
        r = client.completions.create(model=ready["model"], prompt=prompts[1], max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == llm.generate([{"prompt_token_ids": prompts[1]}], greedy)[0].outputs[0].text
        again = c.event("ready_again")
        ranks = psutil.Process(again["pid"]).children()
        assert len(ranks) == 1
        seen = len(c.events)
        os.kill(again["pid"], signal.SIGTERM)  # drains, stops its engine's other rank, exits 0
        wait_for(lambda: not ranks[0].is_running() or ranks[0].status() == psutil.STATUS_ZOMBIE, 60,
                 "the drained worker's other rank to exit")
        wait_for(lambda: c.event("ready_again", after=seen), 120, "the drained worker started again",
                 state=lambda: c.log[-5:])
        assert c.event("exited", after=seen)["code"] == 0
        r = client.completions.create(model=ready["model"], prompt=prompts[2], max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == llm.generate([{"prompt_token_ids": prompts[2]}], greedy)[0].outputs[0].text
    finally:
        c.close()
