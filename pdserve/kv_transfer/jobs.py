"""What the engine thread queues for a socket sender's thread, in the order it must go out."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kv_transfer.base import Lease
from pdserve.outputs import TokenLogprobs


@dataclass(slots=True)
class WriteJob:
    """The KV of `layers` at positions [start, end), read from this side's slot runs."""

    lease: Lease
    layers: range
    start: int
    end: int
    src_runs: list[tuple[int, int]]

    def continued_by(self, nxt: WriteJob) -> bool:
        """Whether `nxt` writes the next layer of the same positions from the same slots."""
        return (nxt.lease is self.lease and nxt.layers.start == self.layers.stop
                and (nxt.start, nxt.end, nxt.src_runs) == (self.start, self.end, self.src_runs))

    def merged(self, nxt: WriteJob) -> WriteJob:
        return WriteJob(self.lease, range(self.layers.start, nxt.layers.stop), self.start, self.end, self.src_runs)


@dataclass(slots=True)
class ClaimJob:
    """In-place writers: ask the peer to bind the lease to this sender before the first copy."""

    lease: Lease


@dataclass(slots=True)
class NotifyJob:
    lease: Lease
    first_token: int
    times: tuple[float, float]  # (queue, compute) seconds the prefill spent here
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    feature: bytes = b""  # a draft head's, at the last token


@dataclass(slots=True)
class AbortJob:
    lease: Lease
    reason: str


@dataclass(slots=True)
class AckJob:
    """Acknowledge the peer's abort of a lease: no write for it follows."""

    request_id: str
    fence: int


@dataclass(slots=True)
class RenewJob:
    """Tell the peer the lease's prompt is paused, not lost."""

    lease: Lease


@dataclass(slots=True)
class ForgetJob:
    """Drop the request's bookkeeping, after everything queued before."""

    lease: Lease


Job = WriteJob | ClaimJob | NotifyJob | AbortJob | AckJob | RenewJob | ForgetJob
