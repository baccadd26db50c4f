"""The messages between processes: each round-trips, each refuses what its bounds refuse with the
field named, and nothing but token ids crosses from a worker."""

from __future__ import annotations

import msgspec
import pytest

from pdserve import wire
from pdserve.sampling_params import SamplingParams

LEASE = dict(request_id="r-1", fence=7, prompt_token_ids=[1, 2, 3], sampling=wire.Sampling(seed=3),
             start=0, block_table=[4], block_size=4, model_hash="h",
             decode=wire.DecodeOffers(tcp=wire.TcpOffer(host="127.0.0.1", port=9)))

MESSAGES = [
    wire.GenerateRequest(prompt_token_ids=[1, 2], output_token_ids=[3], priority=-2,
                         sampling=wire.Sampling(n=2, temperature=0.5, top_k=5, stop_token_ids=[9]),
                         prefill_url="http://127.0.0.1:8101"),
    wire.OutputLine(request_id="r", outputs=[wire.CompletionDelta(index=1, token_ids=[5], finish_reason="stop")],
                    finished=True, num_prompt_tokens=2, phase_times={"queue_s": 0.1}),
    wire.ErrorReply(error=wire.ErrorInfo(message="no", type="overloaded", code=503)),
    wire.AbortRequest(request_id="r", fence=3),
    wire.PrefillLease(**LEASE),
    wire.PrefillAccepted(request_id="r", fence=3, backend="tcp"),
    wire.Registration(url="http://127.0.0.1:8101", role="prefill", model_hash="h", block_size=8),
    wire.Registered(worker_id="w0", lease_s=10.0, heartbeat_s=1.0),
    wire.Heartbeat(worker_id="w0", stats=wire.WorkerStats(role="decode", running=3, kv_landed=2)),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    assert wire.decode(wire.encode(message), type(message)) == message


@pytest.mark.parametrize("kind, body, field", [
    (wire.GenerateRequest, {"prompt_token_ids": []}, "prompt_token_ids"),
    (wire.GenerateRequest, {"prompt_token_ids": [1, -1]}, "prompt_token_ids.1"),
    (wire.GenerateRequest, {"prompt_token_ids": [1], "sampling": {"stop": ["x"]}}, "sampling.stop"),
    (wire.GenerateRequest, {"prompt_token_ids": [1], "sampling": {"seed": 1 << 63}}, "sampling.seed"),
    (wire.GenerateRequest, {"prompt_token_ids": [1], "prefill_url": "file:///etc/passwd"}, "prefill_url"),
    (wire.GenerateRequest, {"prompt_token_ids": [True]}, "prompt_token_ids.0"),
    (wire.PrefillLease, {**msgspec.to_builtins(wire.PrefillLease(**LEASE)), "block_size": 4096}, "block_size"),
    (wire.PrefillLease, {**msgspec.to_builtins(wire.PrefillLease(**LEASE)), "decode": {"pigeon": {}}},
     "decode.pigeon"),
    (wire.Registration, {"url": "http://h:1", "role": "router", "model_hash": "h"}, "role"),
    (wire.Heartbeat, {"worker_id": "w", "stats": {"running": -1}}, "stats.running"),
    (wire.Heartbeat, {"worker_id": "w", "stats": {"capacity": 1 << 41}}, "stats.capacity"),
    (wire.AbortRequest, {"request_id": "a b"}, "request_id"),
    # `$` would let a trailing newline through; every pattern ends in \Z
    (wire.AbortRequest, {"request_id": "a\n"}, "request_id"),
    (wire.Registration, {"url": "http://h:1\n", "role": "decode", "model_hash": "h"}, "url"),
    (wire.Registration, {"url": "http://h:1", "role": "decode", "model_hash": "h", "node": "n\n"}, "node"),
    (wire.Registration, {"url": "http://h:1", "role": "decode", "model_hash": "h", "node": "a b"}, "node"),
    (wire.Registration, {"url": "http://h:1", "role": "decode", "model_hash": "h", "node": "n" * 129}, "node"),
    (wire.AbortRequest, {}, "request_id"),
    (wire.GenerateRequest, {"prompt_token_ids": [1], "resume_of": "a b"}, "resume_of"),
    (wire.GenerateRequest, {"prompt_token_ids": [1], "resume_of": "r" * 1000}, "resume_of"),
    (wire.Heartbeat, {"worker_id": "w", "stats": {"durable_kv": "0f\n"}}, "stats.durable_kv"),
    (wire.Heartbeat, {"worker_id": "w", "stats": {"durable_kv": "../etc"}}, "stats.durable_kv"),
])
def test_a_bad_message_is_refused_naming_its_field(kind, body, field):
    with pytest.raises(wire.BadMessage) as e:
        wire.decode(msgspec.json.encode(body), kind)
    assert e.value.field == field and str(e.value).startswith(field + ": ")


def test_a_body_that_is_no_json_is_refused_without_a_field():
    with pytest.raises(wire.BadMessage) as e:
        wire.decode(b'{"prompt_token_ids": [1], "sampling": {"temperature": NaN}}', wire.GenerateRequest)
    assert e.value.field is None and "not valid JSON" in str(e.value)


def test_a_stream_line_is_an_output_or_an_error():
    out = MESSAGES[1]
    assert wire.decode_line(wire.encode(out)) == out
    err = wire.decode_line(wire.error_line("the engine stopped"))
    assert isinstance(err, wire.ErrorReply) and err.error.message == "the engine stopped"
    with pytest.raises(wire.BadMessage):
        wire.decode_line(b'{"outputs": [{"index": 0, "token_ids": [1], "text": "hi"}]}')  # text never crosses


SETTINGS = dict(n=2, temperature=0.7, top_p=0.9, top_k=-1, min_p=0.1, seed=5, max_tokens=9, min_tokens=2,
                stop_token_ids=[4], ignore_eos=True, speculate=False)


def test_sampling_crosses_as_the_engine_takes_it():
    sampling = wire.decode(wire.encode(wire.Sampling(**SETTINGS)), wire.Sampling)
    params = sampling.params()
    assert not params.detokenize and params.stop == []
    assert params.clone(detokenize=True) == SamplingParams(**SETTINGS)
    with pytest.raises(ValueError, match="min_tokens"):
        wire.Sampling(min_tokens=5, max_tokens=2).params()


def test_a_prefill_worker_samples_only_the_next_token_with_the_same_sampler():
    sampling = wire.Sampling(**{**SETTINGS, "n": 1})
    params, whole = sampling.first_token_params(resumed=3), sampling.params()
    assert (params.n, params.max_tokens, params.min_tokens, params.stop_token_ids) == (1, 4, 0, [])
    assert params == whole.clone(max_tokens=4, min_tokens=0, stop_token_ids=[])


def test_stop_strings_need_text():
    with pytest.raises(ValueError, match="stop strings need detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
