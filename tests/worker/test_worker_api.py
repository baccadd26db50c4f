"""The worker's control endpoint: bad requests get a 4xx with an OpenAI-shaped error, and the
worker stays healthy; stats and metrics carry what the router's heartbeat needs."""

from __future__ import annotations

import httpx
import pytest

from tests.worker.cluster import WorkerServer, prompt


@pytest.fixture(scope="module")
def decode(tiny_llama):
    w = WorkerServer(tiny_llama, "decode", ["tcp"], worker_args={"max_queued": 4})
    yield w
    w.stop()


def gen(**body):
    return {"prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 2}, **body}


@pytest.mark.parametrize("payload, status, fragment", [
    (b"{not json", 400, "JSON"),
    (gen(prompt_token_ids="hello"), 400, "prompt_token_ids"),
    (gen(prompt_token_ids=[]), 400, "prompt_token_ids"),
    (gen(prompt_token_ids=[1, 2.5]), 400, "prompt_token_ids"),
    (gen(prompt_token_ids=[10**9]), 400, "outside the vocabulary"),
    (gen(sampling={"max_tokens": 0}), 400, "max_tokens"),
    (gen(sampling={"temperature": -1}), 400, "temperature"),
    (gen(sampling={"bogus": 1}), 400, "bogus"),
    (gen(unknown_field=1), 400, "unknown_field"),
    (gen(prompt_token_ids=[5] * 5000), 400, "maximum length"),
    # every field bounded at the edge, whoever holds the token
    (gen(request_id="x#1"), 400, "request_id"),
    (gen(request_id="x" * 300), 400, "request_id"),
    (gen(request_id="line\nbreak"), 400, "request_id"),
    (gen(priority=10**6), 400, "priority"),
    (gen(priority=1.5), 400, "priority"),
    (gen(prompt_token_ids=[-3]), 400, "prompt_token_ids"),
    (gen(output_token_ids=[2**40]), 400, "output_token_ids"),
    (gen(prefill_url="file:///etc/passwd"), 400, "prefill_url"),
    (gen(sampling={"seed": 2**64 - 1, "n": 2}), 400, "seed"),
    (gen(sampling={"top_k": 2**40}), 400, "top_k"),
    (gen(sampling={"stop": [1, 2]}), 400, "stop"),
    (gen(sampling={"stop": ["s"] * 17}), 400, "stop"),
    (gen(sampling={"n": True}), 400, "sampling.n"),
    (gen(sampling={f"k{i}": 1 for i in range(40)}), 400, "sampling"),
    (b'{"prompt_token_ids": [1], "sampling": {"temperature": NaN}}', 400, "JSON"),  # NaN is no JSON
])
def test_bad_generate_requests(decode, payload, status, fragment):
    kw = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
    r = httpx.post(decode.url + "/v1/generate", headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and fragment in err["message"]
    assert httpx.get(decode.url + "/health").json()["status"] == "ok"


def test_roles_refuse_what_they_do_not_serve(decode, tiny_llama):
    # a decode worker ships KV too (for migrations), but only for its own model
    r = httpx.post(decode.url + "/v1/prefill", json={
        "request_id": "x", "fence": 1, "prompt_token_ids": [1], "sampling": {}, "start": 0, "block_table": [0],
        "block_size": 4, "model_hash": "h", "decode": {}})
    assert r.status_code == 409 and "model mismatch" in r.json()["error"]["message"]
    p = WorkerServer(tiny_llama, "prefill", ["tcp"])
    try:
        assert httpx.get(p.url + "/v1/kv_info").status_code == 404
        r = httpx.post(p.url + "/v1/generate", json=gen(prefill_url="http://127.0.0.1:1"))
        assert r.status_code == 404
        # a prefill worker still runs requests colocated (the fallback when no decode worker lives)
        r = httpx.post(p.url + "/v1/generate", json=gen(stream=False, sampling={"max_tokens": 3, "ignore_eos": True}))
        assert sum(len(line["outputs"][0]["token_ids"]) for line in r.json()) == 3
    finally:
        p.stop()


def test_stats_and_metrics(decode):
    r = httpx.post(decode.url + "/v1/generate", json=gen(stream=False, prompt_token_ids=prompt(9)))
    assert r.status_code == 200
    stats = httpx.get(decode.url + "/stats").json()
    for key in ("running", "waiting", "waiting_for_kv", "queued_prefill_tokens", "kv_blocks_used",
                "kv_blocks_total", "step_latency_ewma_ms"):
        assert key in stats
    assert stats["step_latency_ewma_ms"] > 0
    text = httpx.get(decode.url + "/metrics").text
    assert "# TYPE pdserve_worker_kv_blocks_total gauge" in text
    info = httpx.get(decode.url + "/v1/kv_info").json()
    assert info["backends"]["tcp"]["host"] == "127.0.0.1" and info["layout"]["num_layers"] >= 1


def lease(**changes):
    body = {"request_id": "x", "fence": 1, "prompt_token_ids": [1, 2, 3, 4, 5], "sampling": {}, "start": 0,
            "block_table": [0, 1], "block_size": 4, "model_hash": "h", "decode": {}}
    return {**body, **changes}


@pytest.mark.parametrize("body, fragment", [
    (lease(block_table=[0, -1]), "block_table.1"),
    (lease(block_size=1 << 20), "block_size"),
    (lease(fence=-1), "fence"),
    (lease(fence=2**63), "fence"),
    (lease(request_id="a@b"), "request_id"),
    (lease(kv_transfer_dtype="int3"), "kv_transfer_dtype"),
    (lease(decode={"carrier-pigeon": {}}), "decode"),
    (lease(model_hash="h" * 200), "model_hash"),
])
def test_bad_leases(decode, body, fragment):
    r = httpx.post(decode.url + "/v1/prefill", json=body)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
    assert httpx.get(decode.url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("body", [{"request_id": "a b"}, {"request_id": "x", "fence": -2}, {"request_id": 5}, {}])
def test_bad_aborts(decode, body):
    for path in ("/v1/abort", "/v1/prefill/abort"):
        assert httpx.post(decode.url + path, json=body).status_code == 400
