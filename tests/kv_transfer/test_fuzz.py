"""The frame parser under hypothesis: any byte string either parses into a typed header or is
refused with FrameError (or StaleWrite); never another exception, never a write past the sink.
And the other half: every well-formed frame, of any kind and any field values, is accepted and
comes out exactly as it went in, its payload in the sink byte for byte."""

from __future__ import annotations

import socket
import threading

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.kv_transfer.codec import (
    PREFIX, AbortHeader, AckHeader, ClaimHeader, FrameError, FrameKind, FrameLimits, HelloHeader, NotifyHeader,
    StaleWrite, WriteHeader, encode_frame, read_frame,
)

LIMITS = FrameLimits(max_header_bytes=512, max_payload_bytes=4096)


def parse(raw: bytes, sink):
    a, b = socket.socketpair()
    with a, b:
        def feed():
            try:
                a.sendall(raw)
                a.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        t = threading.Thread(target=feed)
        t.start()
        try:
            return read_frame(b, LIMITS, sink)
        except (FrameError, StaleWrite):
            return None
        finally:
            b.close()
            t.join(5)
            assert not t.is_alive()


def bounded_sink(h: WriteHeader, size: int):
    if size > 4096:
        raise AssertionError("the limits let an oversized payload through")
    return [memoryview(bytearray(size))]


settings.register_profile("pdserve", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("pdserve")


@given(st.binary(max_size=200))
@settings(max_examples=300)
def test_arbitrary_bytes(raw):
    parse(raw, bounded_sink)


@given(
    kind=st.sampled_from(list(FrameKind)) | st.integers(0, 255),
    header=st.binary(max_size=120),
    payload_len=st.integers(0, 1 << 20),
    tail=st.binary(max_size=64),
)
@settings(max_examples=300)
def test_valid_prefix_with_arbitrary_header(kind, header, payload_len, tail):
    raw = PREFIX.pack(b"PDKV", 1, int(kind), 0, len(header), payload_len) + header + tail
    parse(raw, bounded_sink)


@given(
    request_id=st.text(max_size=40), fence=st.integers(0, 1 << 62), layer=st.integers(0, 1000),
    start=st.integers(0, 1 << 31), num_tokens=st.integers(0, 1 << 31), payload=st.binary(max_size=300),
    cut=st.integers(0, 400),
)
@settings(max_examples=200)
def test_truncated_and_mismatched_writes(request_id, fence, layer, start, num_tokens, payload, cut):
    frame = b"".join(bytes(b) for b in encode_frame(WriteHeader(request_id, fence, layer, start, num_tokens), payload))
    dest = bytearray(len(payload))

    def sink(h, size):
        return [memoryview(dest)]
    got = parse(frame[: len(frame) - cut] if cut else frame, sink)
    if got is not None:
        assert cut == 0 and bytes(dest) == payload


def wire_ints():
    return st.integers(-(1 << 63), (1 << 64) - 1)  # what msgpack carries


def valid_headers():
    text, number = st.text(max_size=40), st.floats(allow_nan=False)
    return st.one_of(
        st.builds(HelloHeader, text, text, wire_ints(), wire_ints(), wire_ints(), text, text, text),
        st.builds(WriteHeader, text, wire_ints(), wire_ints(), wire_ints(), wire_ints(), text, wire_ints()),
        st.builds(ClaimHeader, text, wire_ints()),
        st.builds(NotifyHeader, text, wire_ints(), wire_ints(), wire_ints(), number, number),
        st.builds(AbortHeader, text, wire_ints(), text),
        st.builds(AckHeader, text, wire_ints(), st.booleans(), text),
    )


@given(headers=st.lists(valid_headers(), min_size=1, max_size=4), data=st.data())
@settings(max_examples=150)
def test_well_formed_frames_are_accepted_and_round_trip(headers, data):
    limits = FrameLimits(max_header_bytes=4096, max_payload_bytes=4096)
    payloads = [data.draw(st.binary(max_size=600)) if isinstance(h, WriteHeader) else b"" for h in headers]
    # a payload sent in two pieces arrives as one, and may land in two pieces of memory
    sent_cuts, dest_cuts = ([data.draw(st.integers(0, len(p))) for p in payloads] for _ in range(2))
    stream = b"".join(bytes(b) for h, p, cut in zip(headers, payloads, sent_cuts)
                      for b in encode_frame(h, p[:cut], p[cut:]))
    a, b = socket.socketpair()
    with a, b:
        feeder = threading.Thread(target=a.sendall, args=(stream,))
        feeder.start()
        try:
            for header, payload, cut in zip(headers, payloads, dest_cuts):
                dest = memoryview(bytearray(len(payload)))

                def sink(h, size):
                    assert h == header and size == len(payload)
                    return [dest[:cut], dest[cut:]]
                assert read_frame(b, limits, sink) == header
                assert bytes(dest) == payload
        finally:
            feeder.join(5)
            assert not feeder.is_alive()
