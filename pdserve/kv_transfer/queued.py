"""What the socket senders (tcp, and the in-place writers: shared memory, NIXL) share: a
`ControlLink` to the decode peer, and a thread that runs the engine thread's calls as jobs in order.

Lifecycle of a sender:
1. The backend prepares (`_setup`: e.g. maps the peer's memory), then the link connects; a refusal
   raises `TransferError` and undoes the preparation.
2. The engine thread queues jobs (jobs.py) and returns at once; the sender thread runs them in
   order, merging writes of consecutive layers of the same positions. `flush()` waits until the
   queue is empty, so the source memory of every write may be reused.
3. An ABORT from the peer stops the lease's jobs, is reported through `on_peer_abort`, and is
   acknowledged after the job in flight.
4. A broken link, or `close()`, fails every request still pending, each reported with no fence.
How a write's bytes reach the peer is the backend's (`_write`): tcp.py sends them in the frame,
in_place.py copies them into the peer's memory and sends the frame alone.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import torch

from pdserve.kv_transfer.api import PeerAbort
from pdserve.kv_transfer.base import (
    DraftKV, KVLayout, Lease, TransferError, TransferStatus, cut_runs, kv_bytes_view, split_layout,
)
from pdserve.kv_transfer.codec import (
    AbortHeader, AckHeader, FrameError, FrameLimits, Header, NotifyHeader, RenewHeader, WriteHeader,
)
from pdserve.kv_transfer.control import ControlLink
from pdserve.kv_transfer.jobs import AbortJob, AckJob, ClaimJob, ForgetJob, Job, NotifyJob, RenewJob, WriteJob
from pdserve.kv_transfer.quant import encoded_size, gather_slots, gather_split, quantize
from pdserve.layers.kernels.native import serial_torch_on_this_thread
from pdserve.outputs import TokenLogprobs

log = logging.getLogger("pdserve.kv_transfer")


class QueuedSender:
    backend = ""  # the name in offers and in HELLO

    def __init__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,
        peer: dict,
        token: str = "",
        name: str = "prefill",
        encoding: str = "raw",
        on_peer_abort: PeerAbort = lambda request_id, fence: None,
        limits: FrameLimits = FrameLimits(),
        draft: DraftKV | None = None,
    ) -> None:
        self.own_layout = layout  # this side's pool
        self.layout = split_layout(layout, peer, draft)  # the peer's: what the frames name and carry
        self.kv_cache = kv_cache
        self.draft = draft  # a draft model's cache: its layers follow the target's (`DraftKV`)
        self._byte_views: dict[int, torch.Tensor] = {}
        self.encoding = encoding
        self.on_peer_abort = on_peer_abort
        self.limits = limits
        self._status: dict[str, TransferStatus] = {}
        self._aborted_fences: set[int] = set()
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self.bytes_sent = 0
        self._setup(peer)
        try:
            self.link = ControlLink(peer, self.layout, self.backend, token, name, limits)
        except TransferError:
            self._teardown()
            raise
        threading.Thread(target=self._send_loop, name=f"kv-send-{self.backend}", daemon=True).start()
        self.link.start_reading(self._on_frame, self.close)

    # -- what a backend adds -------------------------------------------------------------------

    def _setup(self, peer: dict) -> None:
        """Backend-specific preparation before connecting (e.g. mapping the peer's memory)."""

    def _teardown(self) -> None:
        """Undo `_setup`, once no write can run any more."""

    def _write(self, job: WriteJob) -> None:
        """Get the job's KV to the peer and tell it so (sender thread)."""
        raise NotImplementedError

    def _max_layers_per_write(self, job: WriteJob) -> int:
        """How many layers of the job's positions one merged write may carry: as many as fit a
        quarter of the frame size limit, for a write whose bytes travel in the frame."""
        _, _, layout = self._source(job.layers.start)
        per_layer = max(1, encoded_size(layout, job.end - job.start, self._encoding(job.layers.start)))
        return max(1, self.limits.max_payload_bytes // 4 // per_layer)

    def _claim(self, lease: Lease) -> bool:
        """Bind the lease to this sender on the peer (in-place writers, which queue a `ClaimJob`
        in `prepare`); False if the peer refused."""
        return True

    def _on_ack(self, ack: AckHeader) -> None:
        """Acknowledgements of claims (in-place writers); plain tcp gets none."""

    def _forget_lease(self, lease: Lease) -> None:
        """Backend-specific bookkeeping of a lease to drop."""

    # -- the non-blocking interface (engine thread) ----------------------------------------------

    def write(self, lease: Lease, layer: int, start: int, end: int, src_runs: list[tuple[int, int]]) -> None:
        """Queue layer `layer`'s KV of positions [start, end), read from this side's slot runs
        (in pieces, if one would pass a quarter of the frame size limit)."""
        self._status.setdefault(lease.request_id, TransferStatus.PENDING)
        step = max(1, self.limits.max_payload_bytes // 4 // self._source(layer)[2].slot_bytes)
        for first in range(start, end, step):
            last = min(end, first + step)
            runs = src_runs if (first, last) == (start, end) else cut_runs(src_runs, first - start, last - start)
            self._push(WriteJob(lease, range(layer, layer + 1), first, last, runs))

    def check(self, lease: Lease) -> None:
        """Raise ValueError if the lease names memory this sender cannot write."""

    def prepare(self, lease: Lease) -> None:
        """Get ready to write the lease (in-place writers claim it), while its prefill computes."""

    def notify(self, lease: Lease, first_token: int, times: tuple[float, float] = (0.0, 0.0),
               logprobs: TokenLogprobs | None = None,
               prompt_logprobs: list[TokenLogprobs | None] | None = None, feature: bytes = b"") -> None:
        """After the lease's writes: the first token (with its log-probabilities, and the prompt's,
        where the request asked for them; a draft head's feature), and (queue, compute) seconds
        spent here."""
        self._push(NotifyJob(lease, first_token, times, logprobs, prompt_logprobs, feature))

    def abort(self, lease: Lease, reason: str) -> None:
        self._push(AbortJob(lease, reason))

    def renew(self, lease: Lease) -> None:
        """The lease's prompt is paused for a more urgent one: the peer keeps waiting for it."""
        self._push(RenewJob(lease))

    def poll(self, request_id: str) -> TransferStatus:
        return self._status.get(request_id, TransferStatus.PENDING)

    def forget(self, lease: Lease) -> None:
        """Drop the request's bookkeeping once everything queued for it went out."""
        self._push(ForgetJob(lease))

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued job was sent (its source memory may then be reused)."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._jobs and not self._busy or self._closed, timeout):
                raise TransferError(f"KV writes to the decode worker did not drain within {timeout:.0f}s")

    @property
    def alive(self) -> bool:
        return not self._closed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.link.shutdown()

    # -- where a write's bytes come from --------------------------------------------------------

    def _source(self, layer: int) -> tuple[torch.Tensor, int, KVLayout]:
        """The cache a layer number names on the wire (the target's, or the draft model's after
        it), the layer's index in it, and its layout."""
        if layer < self.layout.num_layers:
            return self.kv_cache, layer, self.layout
        if self.draft is None or layer - self.layout.num_layers >= self.draft.layout.num_layers:
            raise TransferError(f"layer {layer} is neither the model's nor its draft model's")
        return self.draft.cache, layer - self.layout.num_layers, self.draft.layout

    def _gather(self, cache: torch.Tensor, index: int, runs: list[tuple[int, int]]) -> torch.Tensor:
        """One layer of `_source`'s cache at the slot runs, as the peer's pool holds that layer."""
        if cache is not self.kv_cache:
            return gather_slots(cache, index, runs)
        return gather_split(cache, self.own_layout.ranks, self.layout.ranks, index, runs)

    def _encoding(self, layer: int) -> str:
        """How a layer's KV travels in a frame: as `--kv-transfer-dtype` says; a draft model's raw."""
        return self.encoding if layer < self.layout.num_layers else "raw"

    def _send_payload(self, job: WriteJob) -> None:
        """Send the job's KV in a WRITE frame: gathered straight from the cache's slots, or
        quantized (sender thread)."""
        encoding = self._encoding(job.layers.start)
        payload = []
        for layer in job.layers:
            cache, index, _ = self._source(layer)
            split = cache is self.kv_cache and self.own_layout.ranks != self.layout.ranks
            if encoding == "raw" and cache.device.type == "cpu" and not split:
                view = self._byte_views.get(id(cache))
                if view is None:
                    view = self._byte_views[id(cache)] = kv_bytes_view(cache)
                payload += [view[index, s : s + n].numpy().data for s, n in job.src_runs]
            elif encoding == "raw":
                kv = self._gather(cache, index, job.src_runs)
                payload.append(kv.contiguous().cpu().view(torch.uint8).numpy().data)
            else:
                payload.append(quantize(self._gather(cache, index, job.src_runs), encoding))
        lease = job.lease
        self.link.send(WriteHeader(lease.request_id, lease.fence, job.layers.start, job.start, job.end - job.start,
                                   encoding, len(job.layers)), *payload)
        self.bytes_sent += sum(memoryview(p).nbytes for p in payload)

    # -- sender thread -------------------------------------------------------------------------

    def _push(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                if isinstance(job, (WriteJob, NotifyJob)):
                    self._status[job.lease.request_id] = TransferStatus.FAILED
                return
            self._jobs.append(job)
            self._cond.notify_all()

    def _send_loop(self) -> None:
        serial_torch_on_this_thread()  # the engine thread keeps the process's only OpenMP pool
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if self._closed:
                    self._fail_all()
                    self._teardown()
                    return
                job = self._coalesce(self._jobs.popleft())
                self._busy = True
            try:
                self._run(job)
            except (OSError, TransferError) as e:
                log.warning("KV link to the decode worker (%s) failed: %s", self.backend, e)
                self.close()
            except Exception:  # a bug must not leave requests waiting on a dead thread
                log.exception("KV sender (%s) failed", self.backend)
                self.close()
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _coalesce(self, job: Job) -> Job:
        """Merge queued writes of the next layers of the same positions into one job (one copy,
        one transfer, one frame), up to a quarter of the frame size limit. Called under the lock."""
        if not isinstance(job, WriteJob):
            return job
        max_layers = self._max_layers_per_write(job)
        while self._jobs and len(job.layers) < max_layers:
            nxt = self._jobs[0]
            if not (isinstance(nxt, WriteJob) and job.continued_by(nxt)) or nxt.layers.start == self.layout.num_layers:
                break
            self._jobs.popleft()
            job = job.merged(nxt)
        return job

    def _run(self, job: Job) -> None:
        if isinstance(job, AckJob):
            self.link.send(AckHeader(job.request_id, job.fence, ok=True))
            return
        lease = job.lease
        if isinstance(job, ForgetJob):
            self._status.pop(lease.request_id, None)
            self._aborted_fences.discard(lease.fence)
            self._forget_lease(lease)
            return
        if lease.fence in self._aborted_fences:
            return  # the peer gave this lease up: nothing more goes to it
        if isinstance(job, WriteJob):
            self._write(job)
        elif isinstance(job, ClaimJob):
            self._claim(lease)
        elif isinstance(job, RenewJob):
            self.link.send(RenewHeader(lease.request_id, lease.fence))
        elif isinstance(job, NotifyJob):
            self.link.send(NotifyHeader.of(lease, job.first_token, job.times, job.logprobs, job.prompt_logprobs,
                                           job.feature))
            self._status[lease.request_id] = TransferStatus.DONE
        elif isinstance(job, AbortJob):
            self._aborted_fences.add(lease.fence)
            self.link.send(AbortHeader(lease.request_id, lease.fence, job.reason))
            self._status[lease.request_id] = TransferStatus.ABORTED

    def _fail_all(self) -> None:
        for request_id, status in self._status.items():
            if status == TransferStatus.PENDING:
                self._status[request_id] = TransferStatus.FAILED
                self.on_peer_abort(request_id, None)

    # -- reader thread -------------------------------------------------------------------------

    def _on_frame(self, header: Header) -> None:
        if isinstance(header, AbortHeader):
            with self._cond:
                self._aborted_fences.add(header.fence)
            if self._status.get(header.request_id) == TransferStatus.PENDING:
                self._status[header.request_id] = TransferStatus.ABORTED
            self.on_peer_abort(header.request_id, header.fence)
            # after whatever write is in flight: the ack promises no more writes follow
            self._push(AckJob(header.request_id, header.fence))
        elif isinstance(header, AckHeader):
            self._on_ack(header)
        else:
            raise FrameError(f"unexpected {type(header).__name__} from a decode peer")
