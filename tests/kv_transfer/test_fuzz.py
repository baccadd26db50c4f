"""The frame parser under hypothesis: any byte string either parses into a typed header or is
refused with FrameError (or StaleWrite); never another exception, never a write past the sink."""

from __future__ import annotations

import socket
import threading

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.kv_transfer.codec import (
    PREFIX, FrameError, FrameKind, FrameLimits, StaleWrite, WriteHeader, encode_frame, read_frame,
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
