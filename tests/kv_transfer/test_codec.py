"""The tcp backend's frame format: round trips, and every malformed frame refused cleanly."""

import random
import socket
import subprocess
import sys
import threading

import msgspec
import pytest

from pdserve.kv_transfer.codec import (
    PREFIX, AbortHeader, FrameError, StaleWrite, FrameKind, FrameLimits, NotifyHeader, WriteHeader, decode_prefix,
    encode_frame, read_frame,
)

LIMITS = FrameLimits(max_header_bytes=4096, max_payload_bytes=1 << 20)


def send(sock: socket.socket, buffers) -> None:
    try:
        for b in buffers:
            sock.sendall(b)
        sock.shutdown(socket.SHUT_WR)  # the reader sees the end instead of waiting for more
    except OSError:
        pass  # the reader refused the frame and closed its end


def exchange(frame_buffers, sink):
    a, b = socket.socketpair()
    with a, b:
        t = threading.Thread(target=send, args=(a, frame_buffers))
        t.start()
        try:
            return read_frame(b, LIMITS, sink)
        finally:
            b.close()
            t.join(timeout=10)
            assert not t.is_alive()


def test_write_lands_in_the_leased_memory():
    payload = bytes(random.Random(0).randrange(256) for _ in range(4096))
    dest = bytearray(4096)
    header = WriteHeader("r1", fence=3, layer=2, start=16, num_tokens=8)
    view = memoryview(dest)
    got = exchange(encode_frame(header, payload[:1000], payload[1000:]), lambda h, n: [view[3000:], view[:3000]])
    assert got == header and bytes(dest) == payload[1096:] + payload[:1096]


def test_control_frames_round_trip():
    for header in [NotifyHeader("r1", 1, first_token=42, num_prompt_tokens=17), AbortHeader("r1", 1, "client gone")]:
        assert exchange(encode_frame(header), lambda h: pytest.fail("no payload expected")) == header


def test_payload_must_match_the_lease():
    dest = bytearray(100)
    frame = encode_frame(WriteHeader("r1", 1, 0, 0, 4), b"x" * 64)
    with pytest.raises(FrameError, match="lease expects 100"):
        exchange(frame, lambda h, n: [memoryview(dest)])
    assert bytes(dest) == bytes(100)  # nothing written


def test_a_refusing_sink_writes_nothing():
    def refuse(h, n):
        raise FrameError(f"unknown request {h.request_id}")
    with pytest.raises(FrameError, match="unknown request r1"):
        exchange(encode_frame(WriteHeader("r1", 1, 0, 0, 2), b"x" * 8), refuse)


def test_a_stale_write_is_dropped_and_the_stream_goes_on():
    a, b = socket.socketpair()
    frames = encode_frame(WriteHeader("r1", 1, 0, 0, 2), b"x" * 3000) + encode_frame(AbortHeader("r1", 1))

    def stale(h, n):
        raise StaleWrite(f"fence {h.fence} is stale")
    with a, b:
        t = threading.Thread(target=send, args=(a, frames))
        t.start()
        with pytest.raises(StaleWrite):
            read_frame(b, LIMITS, stale)
        assert read_frame(b, LIMITS, stale) == AbortHeader("r1", 1)
        t.join(timeout=10)
        assert not t.is_alive()


@pytest.mark.parametrize("mutate, message", [
    (lambda p: b"NOPE" + p[4:], "bad magic"),
    (lambda p: p[:4] + bytes([9]) + p[5:], "version 9"),
    (lambda p: p[:5] + bytes([77]) + p[6:], "unknown KV frame kind 77"),
    (lambda p: PREFIX.pack(b"PDKV", 1, 1, 0, 1 << 20, 0), "header of 1048576 bytes exceeds"),
    (lambda p: PREFIX.pack(b"PDKV", 1, 1, 0, 10, 1 << 40), "payload of 1099511627776 bytes exceeds"),
    (lambda p: PREFIX.pack(b"PDKV", 1, int(FrameKind.ABORT), 0, 10, 5), "ABORT frames carry no payload"),
])
def test_bad_prefixes_are_refused_before_reading_more(mutate, message):
    prefix = encode_frame(AbortHeader("r", 1))[0][: PREFIX.size]
    with pytest.raises(FrameError, match=message):
        decode_prefix(mutate(prefix), LIMITS)


def test_malformed_and_truncated_frames():
    good = encode_frame(NotifyHeader("r1", 1, 5, 3))[0]
    bad_header = PREFIX.pack(b"PDKV", 1, int(FrameKind.NOTIFY), 0, 3, 0) + b"\x93\x01\x02"
    with pytest.raises(FrameError, match="malformed NOTIFY header"):
        exchange([bad_header], lambda h, n: None)
    with pytest.raises(FrameError, match="closed mid-frame"):
        exchange([good[:-2]], lambda h, n: None)


def test_random_bytes_never_crash_the_parser():
    rng = random.Random(1)
    for _ in range(300):
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        if rng.random() < 0.5:  # a valid prefix followed by junk reaches the header decoder
            junk = PREFIX.pack(b"PDKV", 1, rng.randrange(1, 7), 0, len(junk), 0) + junk
        try:
            exchange([junk], lambda h, n: [memoryview(bytearray(0))])
        except FrameError:
            pass


def test_wire_code_imports_no_pickle():
    # The module alone, in a fresh interpreter (the package's own __init__ brings in torch).
    from pdserve.kv_transfer import codec

    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('codec', {codec.__file__!r})\n"
        "module = sys.modules['codec'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "assert 'pickle' not in sys.modules, 'pickle imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_notify_carries_the_first_tokens_logprobs_and_refuses_values_no_model_gives():
    from pdserve.outputs import TokenLogprobs

    lease = type("L", (), {"request_id": "r1", "fence": 1, "end": 17})()
    header = NotifyHeader.of(lease, 42, (0.1, 0.2), TokenLogprobs(42, -0.25, [(42, -0.25), (7, -1.5)]))
    raw = encode_frame(header)[0]
    back = msgspec.msgpack.decode(raw[PREFIX.size:], type=NotifyHeader)
    assert back.logprobs() == TokenLogprobs(42, -0.25, [(42, -0.25), (7, -1.5)])
    assert NotifyHeader.of(lease, 42, (0.0, 0.0), None).logprobs() is None
    for bad in (dict(logprob=0.5), dict(logprob=float("nan")), dict(logprob=-1.0, top=[(-3, -1.0)]),
                dict(logprob=-1.0, top=[(1, -1.0)] * 21), dict(top=[(1, -1.0)])):
        with pytest.raises(ValueError):
            NotifyHeader("r1", 1, 42, 17, **bad).logprobs()


def test_a_first_token_without_the_logprobs_its_request_asks_for_is_not_taken(tiny_llama):
    from pdserve import SamplingParams
    from pdserve.engine.llm_engine import LLMEngine
    from tests.factories import engine_config

    engine = LLMEngine(engine_config(tiny_llama, "decode"))
    engine.add_request("r", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2, logprobs=1),
                       remote_prefill=True)
    engine.step()  # its blocks are reserved: it waits for its KV
    with pytest.raises(ValueError, match="log-probabilities"):
        engine.kv_landed("r", 5, (0.0, 0.0), None)
    engine.kv_failed("r")  # what the decode worker does then: the prompt is computed here
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert len(outs[-1].outputs[0].logprobs) == 2


def test_a_notify_carries_the_prompts_logprobs_within_its_own_bound():
    """A prompt's log-probabilities make a NOTIFY header far larger than any other (64 KiB): it has
    a bound of its own; the list must be the prompt's length, the first entry null."""
    from pdserve.outputs import TokenLogprobs

    n = 3000
    lease = type("L", (), {"request_id": "r1", "fence": 1, "end": n})()
    prompt = [None] + [TokenLogprobs(i, -0.5, [(i, -0.5)] + [(j, -1.0 - j) for j in range(19)]) for i in range(1, n)]
    header = NotifyHeader.of(lease, 42, (0.0, 0.0), None, prompt)
    frame = encode_frame(header)[0]
    assert len(frame) > LIMITS.max_header_bytes  # larger than any other header may be
    assert exchange([frame], lambda h, n: None).prompt_logprobs() == prompt
    with pytest.raises(FrameError, match="exceeds"):
        decode_prefix(frame[:PREFIX.size], FrameLimits(max_notify_bytes=LIMITS.max_header_bytes))
    for bad in ([None] * (n - 1), prompt[1:] + [None], [None] + [(1, 0.5, [])] * (n - 1),
                [None] + [(1, -0.5, [(-1, -1.0)])] * (n - 1)):
        with pytest.raises(ValueError):
            NotifyHeader("r1", 1, 42, n, prompt=[e if e is None or isinstance(e, tuple) else
                                                 (e.token_id, e.logprob, e.top) for e in bad]).prompt_logprobs()
