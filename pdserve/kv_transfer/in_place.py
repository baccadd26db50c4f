"""Senders that write the bytes into the decode worker's memory themselves (shared memory, NIXL);
the control link (control.py) carries only the frames that say what was written.

Lifecycle of a lease on such a sender:
1. `prepare`: the lease is CLAIMed while its prefill computes; the decode worker confirms it is
   open and binds it to this peer (a refused claim ends the lease here like a peer abort).
2. Each write copies the layers' slot runs straight into the decode worker's blocks (only into
   runs inside its pool, whatever the lease says), then reports them with a "direct" WRITE.
3. An ABORT from the decode worker is acknowledged after the copy in flight: only then may it
   reuse the blocks (it cuts off a peer that never acknowledges, after a grace period).
"""

from __future__ import annotations

import threading

from pdserve.kv_transfer.base import Lease, TransferError
from pdserve.kv_transfer.codec import AckHeader, ClaimHeader, WriteHeader
from pdserve.kv_transfer.jobs import ClaimJob, WriteJob
from pdserve.kv_transfer.queued import QueuedSender

CLAIM_TIMEOUT_S = 10.0


class InPlaceSender(QueuedSender):
    """Writes the bytes into the decode worker's memory itself (shared memory, NIXL); the socket
    carries only frames. A lease is CLAIMed before its first write: the decode worker confirms it
    is open and binds it to this peer, and from then on waits for this peer's acknowledgement
    before reusing its blocks."""

    peer_slots = 0  # slots per layer of the peer's pool, set by `_setup`

    def _setup(self, peer: dict) -> None:
        if self.encoding != "raw":
            raise TransferError(f"{self.backend} writes the cache's own dtype in place; drop --kv-transfer-dtype")
        self._claims: dict[int, threading.Event] = {}
        self._claimed: dict[int, bool] = {}

    def _max_layers_per_write(self, job: WriteJob) -> int:
        if job.layers.start >= self.layout.num_layers:
            return super()._max_layers_per_write(job)  # a draft model's KV, in the frame
        return self.layout.num_layers  # frames carry no payload: no size limit to respect

    def _copy(self, layers: range, src_runs: list[tuple[int, int]], dst_runs: list[tuple[int, int]]) -> int:
        """Write these layers' KV from this side's slot runs into the peer's; returns bytes."""
        raise NotImplementedError

    def check(self, lease: Lease) -> None:
        try:
            self._runs_in_pool(lease, lease.start, lease.end)
        except TransferError as e:  # the lease is bad, not the link
            raise ValueError(str(e)) from None

    def _runs_in_pool(self, lease: Lease, start: int, end: int) -> list[tuple[int, int]]:
        """The peer's slot runs of positions [start, end), each inside its pool: the copy indexes
        the pool with them, where a negative start would count from its end, into other blocks."""
        runs = lease.slot_runs(start, end)  # refuses negative block ids
        for s, n in runs:
            if s < 0 or s + n > self.peer_slots:
                raise TransferError(f"lease {lease.fence} of request {lease.request_id!r} names slots [{s}, {s + n}) "
                                    f"outside the decode worker's pool of {self.peer_slots}")
        return runs

    def _write(self, job: WriteJob) -> None:
        lease = job.lease
        if job.layers.start >= self.layout.num_layers:  # a draft model's KV: small, sent in the frame
            if self._claim(lease):
                self._send_payload(job)
            return
        dst_runs = self._runs_in_pool(lease, job.start, job.end)
        if not self._claim(lease):
            return
        self.bytes_sent += self._copy(job.layers, job.src_runs, dst_runs)
        self.link.send(WriteHeader(lease.request_id, lease.fence, job.layers.start, job.start, job.end - job.start,
                                   "direct", len(job.layers)))

    def prepare(self, lease: Lease) -> None:
        self._push(ClaimJob(lease))

    def _claim(self, lease: Lease) -> bool:
        if lease.fence in self._claimed:
            return self._claimed[lease.fence]
        event = self._claims.setdefault(lease.fence, threading.Event())
        self.link.send(ClaimHeader(lease.request_id, lease.fence))
        if not event.wait(CLAIM_TIMEOUT_S):
            raise TransferError(f"the decode worker did not answer the claim of lease {lease.fence}")
        ok = self._claimed.get(lease.fence, False)
        if not ok:
            self._aborted_fences.add(lease.fence)
        return ok

    def _forget_lease(self, lease: Lease) -> None:
        self._claimed.pop(lease.fence, None)

    def _on_ack(self, ack: AckHeader) -> None:
        event = self._claims.pop(ack.fence, None)
        if event is not None:
            self._claimed[ack.fence] = ack.ok
            event.set()

    def close(self) -> None:
        super().close()
        for event in list(self._claims.values()):
            event.set()
