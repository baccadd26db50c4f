"""The KV wire format of the `tcp` transfer backend.

A frame is a fixed 20-byte prefix, a msgpack header (msgspec, typed per frame kind), then raw
payload bytes (KV block data, received straight into destination memory):

    magic "PDKV" | version u8 | kind u8 | reserved u16 | header length u32 | payload length u64

Sizes are checked against limits before a byte of header or payload is read, and a WRITE's
payload must match the exact destination the receiver's lease gives it. A connection may sit idle
between frames for as long as it likes (senders are pooled), but once a frame's first byte is in,
the rest must follow within `FrameLimits.frame_timeout_s`: a peer that stalls mid-frame would
otherwise hold the reader, and the blocks a WRITE is landing in, for good. Nothing here can execute
code from the wire: msgspec decodes into fixed struct types only, and this module imports no
torch, so no code-executing deserializer is even loaded (a test checks it).
"""

from __future__ import annotations

import enum
import math
import select
import socket
import struct
import time
from dataclasses import dataclass
from typing import Callable

import msgspec

from pdserve.limits import MAX_LOGPROBS
from pdserve.outputs import TokenLogprobs

MAGIC = b"PDKV"
VERSION = 1
PREFIX = struct.Struct("<4sBBHIQ")


class FrameError(ValueError):
    """A frame that breaks the format or the limits; the connection should be dropped."""


class StaleWrite(Exception):
    """A well-formed WRITE the receiver refuses (stale fence, closed lease): its payload is read
    and dropped, and the connection goes on."""


class FrameKind(enum.IntEnum):
    HELLO = 1  # first frame of a connection: who is sending, with which model and KV layout
    WRITE = 2  # KV bytes of one layer for a range of token positions of a request
    CLAIM = 3  # the sender will write into this lease's memory directly (shared memory, NIXL)
    NOTIFY = 4  # prefill finished: the first sampled token
    ABORT = 5
    ACK = 6
    RENEW = 7  # the prompt is paused for a more urgent one, not lost: keep waiting for it


class HelloHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    token: str  # the cluster's shared secret ("" when none is set)
    model_hash: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    backend: str
    sender: str


class WriteHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: str
    fence: int  # the lease generation this write belongs to; stale ones are rejected
    layer: int  # the first of `num_layers` consecutive layers, payload in layer order
    start: int  # first token position
    num_tokens: int
    encoding: str = "raw"  # raw | int8 | fp8; "direct" when the bytes were written in place
    num_layers: int = 1


class ClaimHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: str
    fence: int


class NotifyHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: str
    fence: int
    first_token: int
    num_prompt_tokens: int
    prefill_queue_s: float = 0.0  # how long the request waited on the prefill worker
    prefill_compute_s: float = 0.0  # and how long computing it took there
    # where the request asked for log-probabilities: the first token's, and the most likely tokens'
    logprob: float | None = None
    top: list[tuple[int, float]] = []
    # where it asked for its prompt's (completions' echo): one per prompt token, the first null
    prompt: list[tuple[int, float, list[tuple[int, float]]] | None] | None = None
    # where the workers draft with a draft head: its feature at the last token (float32 values),
    # which the decode worker's first drafts start from
    feature: bytes = b""

    @classmethod
    def of(cls, lease, first_token: int, times: tuple[float, float], logprobs: TokenLogprobs | None,
           prompt_logprobs: list[TokenLogprobs | None] | None = None, feature: bytes = b"") -> NotifyHeader:
        extra = {} if logprobs is None else {"logprob": logprobs.logprob, "top": logprobs.top}
        if prompt_logprobs is not None:
            extra["prompt"] = [None if e is None else (e.token_id, e.logprob, e.top) for e in prompt_logprobs]
        if feature:
            extra["feature"] = feature
        return cls(lease.request_id, lease.fence, first_token, lease.end, *times, **extra)

    def logprobs(self) -> TokenLogprobs | None:
        """The first token's log-probabilities as sent; ValueError for values no model gives."""
        if self.logprob is None:
            if self.top:
                raise ValueError("top log-probabilities without the token's own")
            return None
        return _checked(self.first_token, self.logprob, self.top)

    def prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        """The prompt's log-probabilities as sent: one per prompt token, the first None; ValueError
        for a list of another length or values no model gives."""
        if self.prompt is None:
            return None
        if len(self.prompt) != self.num_prompt_tokens or self.prompt[0] is not None:
            raise ValueError(f"prompt log-probabilities for {len(self.prompt)} positions, the prompt has "
                             f"{self.num_prompt_tokens} (the first without one)")
        return [None if e is None else _checked(*e) for e in self.prompt]


def _checked(token_id: int, logprob: float, top: list[tuple[int, float]]) -> TokenLogprobs:
    values = [logprob, *(lp for _, lp in top)]
    if (token_id < 0 or len(top) > MAX_LOGPROBS or not all(math.isfinite(v) and v <= 0.0 for v in values)
            or any(t < 0 for t, _ in top)):
        raise ValueError("log-probabilities out of range")
    return TokenLogprobs(token_id, logprob, [(int(t), float(lp)) for t, lp in top])


class AbortHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: str
    fence: int
    reason: str = ""


class AckHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: str
    fence: int
    ok: bool
    error: str = ""


class RenewHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: str
    fence: int


Header = HelloHeader | WriteHeader | ClaimHeader | NotifyHeader | AbortHeader | AckHeader | RenewHeader
_HEADER_TYPES: dict[FrameKind, type] = {
    FrameKind.HELLO: HelloHeader,
    FrameKind.WRITE: WriteHeader,
    FrameKind.CLAIM: ClaimHeader,
    FrameKind.NOTIFY: NotifyHeader,
    FrameKind.ABORT: AbortHeader,
    FrameKind.ACK: AckHeader,
    FrameKind.RENEW: RenewHeader,
}
_KINDS = {t: k for k, t in _HEADER_TYPES.items()}
_DECODERS = {k: msgspec.msgpack.Decoder(t) for k, t in _HEADER_TYPES.items()}
_ENCODER = msgspec.msgpack.Encoder()


@dataclass(slots=True, frozen=True)
class FrameLimits:
    max_header_bytes: int = 64 << 10
    # a NOTIFY's header may carry a prompt's log-probabilities: up to ~330 bytes a token with 20
    # most likely tokens each, so about 200k tokens' worth
    max_notify_bytes: int = 64 << 20
    max_payload_bytes: int = 256 << 20
    frame_timeout_s: float = 30.0  # from a frame's first byte to its last

    def __post_init__(self) -> None:
        if self.max_header_bytes < 1 or self.max_payload_bytes < 0:
            raise ValueError(f"max_header_bytes must be >= 1 and max_payload_bytes >= 0, got {self.max_header_bytes} "
                             f"and {self.max_payload_bytes}")
        if not self.frame_timeout_s > 0:
            raise ValueError(f"frame_timeout_s must be > 0, got {self.frame_timeout_s}")


def encode_frame(header: Header, *payload: bytes | memoryview) -> list[bytes | memoryview]:
    """The frame as buffers for `socket.sendmsg`; payload pieces are sent in order, not copied."""
    kind = _KINDS[type(header)]
    views = [memoryview(p).cast("B") for p in payload]
    size = sum(v.nbytes for v in views)
    if kind != FrameKind.WRITE and size:
        raise FrameError(f"{kind.name} frames carry no payload")
    raw = _ENCODER.encode(header)
    return [PREFIX.pack(MAGIC, VERSION, kind, 0, len(raw), size) + raw, *views]


def decode_prefix(prefix: bytes, limits: FrameLimits) -> tuple[FrameKind, int, int]:
    magic, version, kind, _, header_len, payload_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FrameError("not a pdserve KV frame (bad magic)")
    if version != VERSION:
        raise FrameError(f"KV frame version {version}, this side speaks {VERSION}")
    try:
        kind = FrameKind(kind)
    except ValueError:
        raise FrameError(f"unknown KV frame kind {kind}") from None
    header_limit = limits.max_notify_bytes if kind == FrameKind.NOTIFY else limits.max_header_bytes
    if header_len > header_limit:
        raise FrameError(f"KV frame header of {header_len} bytes exceeds {header_limit}")
    if payload_len > limits.max_payload_bytes:
        raise FrameError(f"KV frame payload of {payload_len} bytes exceeds {limits.max_payload_bytes}")
    if kind != FrameKind.WRITE and payload_len:
        raise FrameError(f"{kind.name} frames carry no payload, got {payload_len} bytes")
    return kind, header_len, payload_len


def decode_header(kind: FrameKind, raw: bytes) -> Header:
    try:
        return _DECODERS[kind].decode(raw)
    except msgspec.DecodeError as e:
        raise FrameError(f"malformed {kind.name} header: {e}") from None


# Given a WRITE header and its payload size, the receiver returns the memory the payload must land
# in (pieces filled in order, sized by the lease); it raises StaleWrite to drop the payload, or
# FrameError to refuse the frame and drop the connection.
PayloadSink = Callable[[WriteHeader, int], list[memoryview]]


def read_frame(sock: socket.socket, limits: FrameLimits, sink: PayloadSink, deadline: float | None = None) -> Header:
    """Reads one frame; a WRITE's payload goes straight into the memory `sink` hands out.

    Waits as long as it takes for the frame's first byte, or until `deadline` (monotonic; a
    handshake bounds its whole frame); the rest must arrive within `limits.frame_timeout_s`."""
    prefix = bytearray(PREFIX.size)
    view = memoryview(prefix)
    got = _recv_first(sock, view, deadline)
    frame_deadline = time.monotonic() + limits.frame_timeout_s
    deadline = frame_deadline if deadline is None else min(deadline, frame_deadline)
    _recv_into_exact(sock, view[got:], deadline, got)
    kind, header_len, payload_len = decode_prefix(prefix, limits)
    header = decode_header(kind, _recv_exact(sock, header_len, deadline))
    if kind == FrameKind.WRITE:
        try:
            dest = [v.cast("B") for v in sink(header, payload_len)]
        except StaleWrite:
            _discard(sock, payload_len, deadline)
            raise
        expected = sum(v.nbytes for v in dest)
        if expected != payload_len:
            raise FrameError(
                f"WRITE for {header.request_id!r} carries {payload_len} bytes, its lease expects {expected}"
            )
        for view in dest:
            _recv_into_exact(sock, view, deadline)
    return header


def _discard(sock: socket.socket, n: int, deadline: float) -> None:
    scratch = memoryview(bytearray(min(n, 1 << 20)))
    while n:
        _recv_into_exact(sock, scratch[: min(n, len(scratch))], deadline)
        n -= min(n, len(scratch))


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytearray:
    buf = bytearray(n)
    _recv_into_exact(sock, memoryview(buf), deadline)
    return buf


def _recv_first(sock: socket.socket, view: memoryview, deadline: float | None) -> int:
    """At least the first byte of a frame: an idle connection may wait for it without limit."""
    n = sock.recv_into(view) if deadline is None else _recv_before(sock, view, deadline)
    if n == 0:
        raise FrameError(f"connection closed mid-frame (0 of {len(view)} bytes)")
    return n


def _recv_into_exact(sock: socket.socket, view: memoryview, deadline: float, offset: int = 0) -> None:
    got = 0
    while got < len(view):
        n = _recv_before(sock, view[got:], deadline)
        if n == 0:
            raise FrameError(f"connection closed mid-frame ({offset + got} of {offset + len(view)} bytes)")
        got += n


def _recv_before(sock: socket.socket, view: memoryview, deadline: float) -> int:
    """`recv_into` that gives up at `deadline`. The socket stays in blocking mode (its timeout is
    shared with the thread sending on it): data already queued is taken at once, and only a read
    that finds none polls, so a payload streaming in costs about the calls of a blocking read
    (measured: 1 GiB over loopback took ~600 reads, 26 of which found nothing and polled)."""
    while True:
        try:
            return sock.recv_into(view, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise FrameError("KV frame not complete within its deadline")
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        poller.poll(math.ceil(remaining * 1000))
