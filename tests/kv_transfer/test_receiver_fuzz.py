"""The receiver under hypothesis, over a real socket: whatever a peer sends (junk, well-formed frames
with hostile values, frames with a byte flipped, cut short or a prefix field replaced), the receiver
and its accept loop survive, no byte lands outside a lease's blocks, no lease stays pinned, and a
well-formed peer right after still connects and lands a lease's KV byte for byte."""

from __future__ import annotations

import logging
import socket

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.kv_transfer.codec import (
    PREFIX, AbortHeader, AckHeader, ClaimHeader, FrameLimits, HelloHeader, NotifyHeader, WriteHeader, encode_frame,
)
from pdserve.kv_transfer.leases import EventKind
from pdserve.kv_transfer.quant import ENCODINGS
from tests.kv_transfer.raw_peer import (
    BLOCK, LAYOUT, TOKEN, connect, hello_bytes, kv_data, make_receiver, next_event, open_lease, send,
)
from tests.wait import wait_for

VICTIM_BLOCKS = (1, 2)  # a lease open while the junk arrives: writes to it may land
CHECK_BLOCKS = (5, 6)  # the well-formed peer's lease, opened afterwards
MAX_PAYLOAD = 4096


class Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def errors():
    """What the receiver logs as errors: its reader threads' unexpected exceptions."""
    handler = Errors()
    logging.getLogger("pdserve.kv_transfer").addHandler(handler)
    yield handler.records
    logging.getLogger("pdserve.kv_transfer").removeHandler(handler)


def ints():
    return st.one_of(st.integers(-2, 16), st.integers(-(1 << 63), (1 << 64) - 1))


def near(lo: int, hi: int):
    """Mostly values a real peer would send (so deep paths get reached), anything else otherwise."""
    return st.one_of(st.integers(lo, hi), st.integers(lo, hi), ints())


def writes(victim):
    request_id = st.one_of(st.sampled_from([victim.request_id, "check"]), st.text(max_size=12))
    fence = st.one_of(st.just(victim.fence), ints())
    encoding = st.one_of(st.sampled_from([*ENCODINGS, "bogus"]), st.text(max_size=6))
    return st.builds(WriteHeader, request_id, fence, near(0, 1), near(0, 8), near(1, 8), encoding, near(1, 2))


def headers(victim):
    request_id = st.one_of(st.sampled_from([victim.request_id, "check"]), st.text(max_size=12))
    fence = st.one_of(st.just(victim.fence), ints())
    text = st.text(max_size=12)
    lay = LAYOUT
    return st.one_of(
        st.builds(HelloHeader, st.sampled_from([TOKEN, "", "nope"]), st.sampled_from([lay.model_hash, "x"]),
                  near(lay.num_layers, lay.num_layers), near(lay.num_kv_heads, lay.num_kv_heads),
                  near(lay.head_dim, lay.head_dim), st.sampled_from([lay.dtype, "bfloat16", ""]), text, text),
        writes(victim),
        st.builds(ClaimHeader, request_id, fence),
        st.builds(NotifyHeader, request_id, fence, near(0, 100), near(8, 8), st.floats(), st.floats()),
        st.builds(AbortHeader, request_id, fence, text),
        st.builds(AckHeader, request_id, fence, st.booleans(), text),
    )


@st.composite
def well_formed(draw, victim, kinds=headers) -> bytes:
    header = draw(kinds(victim))
    payload = b""
    if isinstance(header, WriteHeader):
        exact = header.num_layers * header.num_tokens * LAYOUT.slot_bytes
        sizes = st.sampled_from([exact]) if 0 <= exact <= MAX_PAYLOAD else st.nothing()
        payload = bytes([draw(st.integers(1, 255))]) * draw(sizes | st.integers(0, 600))
    return b"".join(bytes(b) for b in encode_frame(header, payload))


@st.composite
def mutated(draw, victim) -> bytes:
    raw = bytearray(draw(well_formed(victim)))
    how = draw(st.sampled_from(["flip", "cut", "field"]))
    if how == "flip":
        i = draw(st.integers(0, len(raw) - 1))
        raw[i] ^= draw(st.integers(1, 255))
    elif how == "cut":
        del raw[draw(st.integers(0, len(raw) - 1)) :]
    else:
        fields = list(PREFIX.unpack(raw[: PREFIX.size]))
        i = draw(st.integers(0, len(fields) - 1))
        fields[i] = draw([st.binary(min_size=4, max_size=4), st.integers(0, 255), st.integers(0, 255),
                          st.integers(0, (1 << 16) - 1), st.integers(0, (1 << 32) - 1),
                          st.integers(0, (1 << 64) - 1)][i])
        raw[: PREFIX.size] = PREFIX.pack(*fields)
    return bytes(raw)


def frames(victim):
    # WRITEs carry the payload, and the most checks: a branch of their own
    return st.one_of(st.binary(max_size=64), well_formed(victim, writes), well_formed(victim), mutated(victim))


def send_junk(rx, say_hello: bool, junk: list[bytes]) -> None:
    """Sends it all and waits until the receiver has read it and let the connection go."""
    with socket.create_connection(rx.address, timeout=10) as sock:
        try:
            sock.sendall((hello_bytes() if say_hello else b"") + b"".join(junk))
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(4096):  # acks and refusals, until the receiver hangs up
                pass
        except OSError:
            pass  # it hung up first
    wait_for(lambda: rx.num_connections == 0, 10, "the receiver hanging up")


def outside(kv: torch.Tensor, blocks) -> torch.Tensor:
    keep = torch.ones(kv.shape[1], dtype=torch.bool)
    for b in blocks:
        keep[b * BLOCK : (b + 1) * BLOCK] = False
    return kv[:, keep]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_no_frame_breaks_the_receiver(errors, data):
    errors.clear()
    rx = make_receiver(limits=FrameLimits(max_header_bytes=1024, max_payload_bytes=MAX_PAYLOAD))
    try:
        check_one_example(rx, data)
        assert not errors, f"{errors[0].getMessage()}: {errors[0].exc_info[1]!r}"
    finally:
        rx.close()


def check_one_example(rx, data) -> None:
    victim = open_lease(rx, blocks=VICTIM_BLOCKS, request_id="victim")
    say_hello = data.draw(st.sampled_from([True, True, True, False]), "hello")
    send_junk(rx, say_hello, data.draw(st.lists(frames(victim), max_size=6), "frames"))

    # No lease stays pinned: the victim either landed, or is (or becomes) releasable once closed.
    rx.close_lease(victim.fence, "example over")
    kinds = []
    while not rx.events.empty():
        ev = rx.events.get()
        assert ev.request_id == victim.request_id and ev.fence == victim.fence, ev
        kinds.append(ev.kind)
    assert EventKind.LANDED in kinds or kinds.count(EventKind.RELEASABLE) == 1, kinds
    assert rx.num_open_leases == 0

    # A well-formed peer still gets through, and its bytes land exactly.
    check = open_lease(rx, blocks=CHECK_BLOCKS, request_id="check")
    with connect(rx) as good:
        for layer in range(LAYOUT.num_layers):
            send(good, WriteHeader("check", check.fence, layer, 0, 8), kv_data(8, 10 + layer))
        send(good, NotifyHeader("check", check.fence, first_token=77, num_prompt_tokens=8))
        ev = next_event(rx)
    assert (ev.kind, ev.request_id, ev.first_token) == (EventKind.LANDED, "check", 77)
    for layer in range(LAYOUT.num_layers):
        for b in CHECK_BLOCKS:
            assert rx.kv_cache[layer, b * BLOCK : (b + 1) * BLOCK].eq(10 + layer).all()
    assert outside(rx.kv_cache, VICTIM_BLOCKS + CHECK_BLOCKS).abs().sum() == 0
