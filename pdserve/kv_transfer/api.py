"""The prefill side's view of a KV transfer backend: one `KVSender` per decode peer and backend.

Every method returns at once (the engine thread calls them between and inside steps); what
happens on the wire happens later, in the order the calls were made. A sender reports what the
decode worker does to a request (an abort, or the link lost) through the `PeerAbort` callback it
was made with, from its own thread.

Lifecycle of a lease on a sender:
1. `check` (refuse a lease naming memory the sender cannot write), then `prepare` while the
   prefill computes (in-place writers claim the lease here).
2. `write` each layer's KV of a range of positions, as the model finishes the layer; `flush`
   after a step, so the step's source blocks may be reused.
3. `notify` with the first token, or `abort`; then `forget` drops the request's bookkeeping.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from pdserve.kv_transfer.base import DraftKV, KVLayout, Lease, TransferStatus
from pdserve.outputs import TokenLogprobs

# (request id, fence): the decode worker ended that lease; fence None: every lease of the request
# on this sender failed with the link.
PeerAbort = Callable[[str, int | None], None]


class KVSender(Protocol):
    bytes_sent: int  # KV bytes that left this side (on the wire, or copied into the peer)
    layout: KVLayout  # the peer's pool, as this side's KV fills it: layers number by it

    def check(self, lease: Lease) -> None:
        """Raise ValueError if the lease names memory this sender cannot write."""
        ...

    def prepare(self, lease: Lease) -> None:
        """Get ready to write the lease, while its prefill computes."""
        ...

    def write(self, lease: Lease, layer: int, start: int, end: int, src_runs: list[tuple[int, int]]) -> None:
        """Queue layer `layer`'s KV of positions [start, end), read from this side's slot runs
        (a layer of the peer's pool, `layout`; layers past the model's are its draft model's, `DraftKV`)."""
        ...

    def notify(self, lease: Lease, first_token: int, times: tuple[float, float] = (0.0, 0.0),
               logprobs: TokenLogprobs | None = None,
               prompt_logprobs: list[TokenLogprobs | None] | None = None, feature: bytes = b"") -> None:
        """After the lease's writes: the first token (with its log-probabilities, and the prompt's,
        where the request asked for them; a draft head's feature at the last token, float32), and
        (queue, compute) seconds spent here."""
        ...

    def abort(self, lease: Lease, reason: str) -> None: ...

    def renew(self, lease: Lease) -> None:
        """The lease's prompt is paused for a more urgent one: the decode worker keeps waiting."""
        ...

    def forget(self, lease: Lease) -> None:
        """Drop the request's bookkeeping once everything queued for it went out."""
        ...

    def poll(self, request_id: str) -> TransferStatus:
        """How the request's transfer stands (the prefill worker itself learns of failures
        through `PeerAbort`; tools and tests ask)."""
        ...

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until queued writes no longer need their source memory; TransferError if they
        did not drain in time."""
        ...

    @property
    def alive(self) -> bool: ...

    def close(self) -> None: ...


class SenderFactory(Protocol):
    """A sender class: connects to the decode peer its offer describes, or raises TransferError
    (`LayoutMismatch` when no backend could ever connect the two workers)."""

    def __call__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,
        peer: dict,
        token: str = "",
        name: str = "prefill",
        encoding: str = "raw",
        on_peer_abort: PeerAbort = ...,
        draft: DraftKV | None = None,
    ) -> KVSender: ...
