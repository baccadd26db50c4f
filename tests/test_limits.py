"""The tiers of `pdserve/limits.py` nest: whatever a client may send, the wire takes, and whatever
the wire carries, the library takes, so a request the router admitted is never refused further in
for its size."""

from __future__ import annotations

import msgspec
import pytest

from pdserve import limits, wire
from pdserve.router.protocol import CompletionRequest
from pdserve.sampling_params import SamplingParams


def test_each_client_bound_is_within_the_wire_and_the_library():
    assert limits.MAX_CLIENT_N <= limits.MAX_N
    assert limits.MAX_CLIENT_PRIORITY <= limits.MAX_WIRE_PRIORITY <= limits.MAX_ABS_PRIORITY
    assert limits.MAX_CLIENT_STOP_STRINGS <= limits.MAX_STOP_STRINGS


def test_the_largest_client_request_passes_every_tier():
    req = CompletionRequest(model="m", prompt=[limits.TOKEN_ID_LIMIT - 1], n=limits.MAX_CLIENT_N,
                            priority=limits.MAX_CLIENT_PRIORITY, top_k=limits.MAX_TOP_K, seed=limits.SEED_LIMIT - 1,
                            max_tokens=limits.MAX_TOKENS_LIMIT,
                            stop=["x" * limits.MAX_STOP_STRING_CHARS] * limits.MAX_CLIENT_STOP_STRINGS)
    sampling = req.sampling(req.max_tokens)
    on_the_wire = msgspec.msgpack.decode(msgspec.msgpack.encode(sampling), type=wire.Sampling)
    assert on_the_wire.params().n == limits.MAX_CLIENT_N
    SamplingParams(n=limits.MAX_CLIENT_N, stop=req.stop_strings())  # the router's own text-side settings
    request = wire.GenerateRequest(request_id="r", prompt_token_ids=[limits.TOKEN_ID_LIMIT - 1], sampling=on_the_wire,
                                   priority=limits.MAX_CLIENT_PRIORITY)
    msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=wire.GenerateRequest)  # the bounds are checked here


def test_one_past_a_client_bound_is_refused_at_the_edge():
    with pytest.raises(ValueError):
        CompletionRequest(model="m", prompt="p", n=limits.MAX_CLIENT_N + 1)
    with pytest.raises(ValueError):
        CompletionRequest(model="m", prompt="p", priority=limits.MAX_CLIENT_PRIORITY + 1)
