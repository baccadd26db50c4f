"""A decode worker SIGKILLed mid-stream under `pdserve serve --durable-kv`: its supervisor starts it
again, it finds its KV pool and journal, and the router resumes every stream there. The clients
(the official `openai` package) see no error, their tokens are the colocated engine's exactly, and
the restarted worker computed no prompt token again."""

from __future__ import annotations

import glob
import os
import signal
import threading

import httpx
import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.credentials import TOKEN_ENV
from pdserve.kv_transfer.shm import shm_available
from tests.serve_process import ServeProcess
from tests.wait import wait_for
from tests.worker.cluster import prompt

pytestmark = pytest.mark.skipif(not shm_available(), reason="needs a writable /dev/shm")

PROMPTS = [prompt(41, seed=11), prompt(23, seed=12), prompt(60, seed=13)]
MAX_TOKENS = 900
TOKEN = "t" * 48


def stream(client: openai.OpenAI, model: str, tokens: list[int], out: list[str], errors: list) -> None:
    try:
        for chunk in client.completions.create(model=model, prompt=tokens, max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
            if chunk.choices:
                out.append(chunk.choices[0].text)
    except Exception as e:  # the test asserts none
        errors.append(e)


@pytest.mark.parametrize("standby,ranks", [(False, 1), (True, 1), (False, 2)],
                         ids=["restarted", "standby", "restarted-two-ranks"])
def test_a_killed_decode_worker_resumes_its_streams_from_its_kv(tiny_llama, standby, ranks):
    """Restarted as a new process, or (`--standby`) replaced by its spare, loaded and waiting; or a
    decode worker of two tensor-parallel ranks, whose pool holds both ranks' heads: its other rank
    goes with it, and the restarted worker's two ranks resume from that pool."""
    c = ServeProcess("--model", str(tiny_llama), "--port", "0", "--prefill", "1", "--decode", "1", "--dtype", "float32",
                     "--kv-cache-memory", "8MiB", "--max-restart-backoff", "0.5", "--durable-kv",
                     *(["--standby"] if standby else []),
                     *([f"--decode-engine-args=--tensor-parallel-size {ranks}"] if ranks > 1 else []),
                     env={**os.environ, TOKEN_ENV: TOKEN})
    try:
        wait_for(lambda: c.event("ready") or c.proc.poll() is not None, 240, "the cluster", state=lambda: c.log[-5:])
        ready = c.event("ready")
        assert ready is not None, c.log[-20:]
        url, model = ready["url"], ready["model"]
        victim = next(p for p in ready["processes"] if p["name"] == "decode worker 1")
        if standby:
            wait_for(lambda: c.event("standby", "decode worker 1"), 120, "the standby", state=lambda: c.log[-5:])
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        outs, errors = [[] for _ in PROMPTS], []
        threads = [threading.Thread(target=stream, args=(client, model, p, o, errors)) for p, o in zip(PROMPTS, outs)]
        for t in threads:
            t.start()
        wait_for(lambda: all(len(o) >= 40 for o in outs) or errors, 60, "tokens before the kill")
        os.kill(victim["pid"], signal.SIGKILL)
        at_kill = [len(o) for o in outs]
        for t in threads:
            t.join(180)
        assert not errors, (errors, c.log[-30:])
        assert all(n < MAX_TOKENS for n in at_kill), "the streams ended before the kill: nothing was resumed"
        restarted = c.event("ready_again", "decode worker 1")
        assert restarted is not None, c.log[-20:]
        assert c.event("restarted", "decode worker 1").get("standby", False) == standby
        stats = httpx.get(restarted["url"] + "/stats", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert stats["kv_pool_generation"] == 2 and stats["kv_resumed_requests"] == len(PROMPTS), stats
        assert stats["kv_resume_recomputed_prompt_tokens"] == 0 and stats["kv_resume_rejected"] == 0
        # the prompts' KV (and the output's, up to the last journal write) came from the pool
        assert stats["tokens_by_source"]["resumed"] >= sum(len(p) for p in PROMPTS), stats
        want = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB").generate(
            [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        assert ["".join(o) for o in outs] == [w.outputs[0].text for w in want]
        metrics = httpx.get(url + "/metrics").text
        assert 'pdserve_migrations_total{reason="resumed"} 3.0' in metrics, metrics
    finally:
        c.close()
    assert not glob.glob(f"/dev/shm/pdserve-kv*-{c.proc.pid}-*")  # the command removed the pools it held
