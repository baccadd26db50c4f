"""What a worker's clients see when things fail: a step that fails as a whole ends every request it
held with the engine-error line (and the worker serves on), a request that breaks a batch fails
alone while its batch mates finish token-exact, and a request past the queue's bound gets a 503.
Every scenario ends with the worker idle: no request, no lease, every KV block free."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from tests.factories import FailingSampler
from tests.wait import wait_for
from tests.worker.cluster import WorkerServer, prompt


@pytest.fixture(scope="module")
def worker(tiny_llama):
    with WorkerServer(tiny_llama, "both", ["tcp"]) as w:
        yield w


def body(tokens: list[int], request_id: str | None = None, max_tokens: int = 4) -> dict:
    return {"request_id": request_id, "prompt_token_ids": tokens,
            "sampling": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}}


def send_together(w: WorkerServer, bodies: list[dict]) -> list[tuple[int, list[dict]]]:
    """Each body's status and stream lines, the requests admitted by the engine in one turn (it is
    held until all of them wait for it), so that they run in the same steps."""
    gate = threading.Event()
    w.worker.loop.call(lambda: gate.wait(30))
    results: list = [None] * len(bodies)

    async def send_all() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(i: int) -> None:
                async with client.stream("POST", w.url + "/v1/generate", json=bodies[i]) as r:
                    lines = [json.loads(line) async for line in r.aiter_lines() if line.strip()]
                    results[i] = (r.status_code, lines)
            await asyncio.gather(*(one(i) for i in range(len(bodies))))

    sender = threading.Thread(target=asyncio.run, args=(send_all(),))
    sender.start()
    try:
        wait_for(lambda: w.worker.loop._calls.qsize() >= len(bodies), 30, "every request waiting for the engine")
    finally:
        gate.set()
    sender.join(120)
    assert not sender.is_alive()
    return results


def tokens(lines: list[dict]) -> list[int]:
    return [t for line in lines if "outputs" in line for t in line["outputs"][0]["token_ids"]]


def test_a_step_that_fails_as_a_whole_ends_every_request_with_the_engine_error(worker, monkeypatch):
    engine = worker.worker.engine
    step, failed = engine.step, []

    def failing_step():
        if not failed and len(engine.request_ids()) == 2:  # once, with both requests in
            failed.append(1)
            raise RuntimeError("the step broke outside any one request")
        return step()
    monkeypatch.setattr(engine, "step", failing_step)
    before = worker.worker.stats()

    results = send_together(worker, [body(prompt(12, seed=1)), body(prompt(9, seed=2))])

    assert failed
    for status, lines in results:
        assert status == 200
        assert lines[-1] == {"error": {"message": "the engine failed while running this request",
                                       "type": "server_error", "param": None, "code": 500}}
        assert all("outputs" in line for line in lines[:-1])
    wait_for(worker.is_idle, 30, "an idle worker")
    after = worker.worker.stats()
    assert after.engine_failures == before.engine_failures + 1
    assert after.requests_aborted == before.requests_aborted + 2  # ended there, not run on unseen
    status, lines = send_together(worker, [body(prompt(12, seed=1))])[0]  # and it serves on
    assert status == 200 and len(tokens(lines)) == 4 and lines[-1]["finished"]
    wait_for(worker.is_idle, 30, "an idle worker")


def test_a_request_that_breaks_its_batch_fails_alone(worker, monkeypatch):
    prompts = [prompt(12, seed=3), prompt(9, seed=4), prompt(15, seed=5)]
    expected = [tokens(lines) for _, lines in send_together(worker, [body(p) for p in prompts])]
    wait_for(worker.is_idle, 30, "an idle worker")

    runner = worker.worker.engine.runner
    monkeypatch.setattr(runner, "sample", FailingSampler(runner.sample, "bad"))
    bodies = [body(prompts[0]), body(prompt(10, seed=6), request_id="bad-1"), body(prompts[1]), body(prompts[2])]
    results = send_together(worker, bodies)

    bad_status, bad_lines = results[1]
    assert bad_status == 200 and bad_lines[-1]["finished"]
    assert bad_lines[-1]["outputs"][0]["finish_reason"] == "error"
    good = [results[0], results[2], results[3]]
    assert [status for status, _ in good] == [200] * 3
    assert [tokens(lines) for _, lines in good] == expected
    assert [lines[-1]["outputs"][0]["finish_reason"] for _, lines in good] == ["length"] * 3
    wait_for(worker.is_idle, 30, "an idle worker")


def test_a_request_past_the_queue_bound_gets_503(tiny_llama):
    # room for one sequence: one running, none queued
    with WorkerServer(tiny_llama, "both", ["tcp"], worker_args={"max_queued": 0}, max_num_seqs=1) as w:
        results = send_together(w, [body(prompt(12, seed=7)), body(prompt(9, seed=8))])
        statuses = sorted(status for status, _ in results)
        assert statuses == [200, 503]
        (admitted,) = [lines for status, lines in results if status == 200]
        (refused,) = [lines for status, lines in results if status == 503]
        assert len(tokens(admitted)) == 4 and admitted[-1]["finished"]
        assert refused == [{"error": {"message": "the worker holds its maximum of 1 sequences, running and queued",
                                      "type": "overloaded", "param": None, "code": 503}}]
        wait_for(w.is_idle, 30, "an idle worker")
        status, lines = send_together(w, [body(prompt(9, seed=8))])[0]  # the refusal left nothing behind
        assert status == 200 and len(tokens(lines)) == 4
        wait_for(w.is_idle, 30, "an idle worker")
