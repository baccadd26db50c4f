"""`pdserve serve --local-kv-store`: the command starts a Valkey server on a private unix socket for
its worker, whose pool is small enough that a conversation's first turn is evicted from it. The
worker is SIGKILLed and started again (its pool and host tier empty): the conversation's second
turn, asked through the official `openai` client, reads its prefix from the store, computes only
its new tokens, and writes what a fresh engine writes. The store's directory goes when the command
stops."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.credentials import TOKEN_ENV
from tests.engine.test_kv_store import HAVE_STORE
from tests.serve_process import ServeProcess
from tests.wait import wait_for
from tests.worker.cluster import prompt

pytestmark = pytest.mark.skipif(not HAVE_STORE, reason="the store extra (a Valkey server) is not installed")

TOKEN = "s" * 48
POOL = ["--kv-cache-memory", str(24 * 2048), "--block-size", "4", "--dtype", "float32"]  # 24 blocks of 4 tokens


def test_a_restarted_worker_reads_a_returning_conversation_from_the_local_store(tiny_llama):
    c = ServeProcess("--model", str(tiny_llama), "--port", "0", "--colocated", "1", "--prefill", "0", "--decode", "0",
                     "--local-kv-store", "64MiB", "--max-restart-backoff", "0.5", *POOL,
                     env={**os.environ, TOKEN_ENV: TOKEN})
    try:
        wait_for(lambda: c.event("ready") or c.proc.poll() is not None, 240, "the cluster", state=lambda: c.log[-5:])
        ready = c.event("ready")
        assert ready is not None, c.log[-20:]
        store_dir = next(line for line in c.log if "KV store: Valkey at unix://" in line).split("unix://")[1].split()[0]
        client = openai.OpenAI(base_url=ready["url"] + "/v1", api_key="none", max_retries=0, timeout=120)

        def turn(tokens: list[int]) -> str:
            r = client.completions.create(model=ready["model"], prompt=tokens, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True})
            return r.choices[0].text

        first = prompt(40, seed=1)
        answer = turn(first)
        for seed in range(2, 5):
            turn(prompt(60, seed=seed))  # the pool holds one of these at a time: turn 1's blocks go
        worker = next(p for p in ready["processes"] if p["name"] != "router")
        os.kill(worker["pid"], signal.SIGKILL)
        wait_for(lambda: c.event("ready_again"), 120, "the worker started again", state=lambda: c.log[-5:])
        url = c.event("ready_again")["url"]
        wait_for(lambda: sum(" registered: " in line for line in c.log) >= 2, 60, "the restarted worker registered",
                 state=lambda: c.log[-5:])
        llm = LLM(str(tiny_llama), dtype="float32", block_size=4)
        greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        answer_ids = llm.generate([{"prompt_token_ids": first}], greedy)[0].outputs[0].token_ids
        second = first + answer_ids + prompt(9, seed=7)
        want = llm.generate([{"prompt_token_ids": second}], greedy)[0].outputs[0]
        assert turn(second) == want.text
        assert answer == llm.generate([{"prompt_token_ids": first}], greedy)[0].outputs[0].text
        stats = httpx.get(url + "/stats", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        prefix = (40 + 16 - 1) // 4 * 4  # turn 1 and its answer but the last token, in whole blocks
        assert stats["tokens_by_source"]["store"] == prefix, stats["tokens_by_source"]
        assert stats["tokens_by_source"]["computed"] == len(second) - prefix
    finally:
        c.close()
    assert not os.path.exists(store_dir)
