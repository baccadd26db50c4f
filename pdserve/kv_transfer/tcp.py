"""The prefill side of KV transfer over a socket: pdserve's own framed protocol.

The KV travels in the frames of the control link (control.py; the queue and its thread are
queued.py's): each WRITE carries one or more layers of a range of positions, gathered straight
from the cache's slots (or quantized, with `--kv-transfer-dtype`), received by the decode worker
straight into the leased blocks.
"""

from __future__ import annotations

import torch

from pdserve.kv_transfer.base import kv_bytes_view
from pdserve.kv_transfer.codec import WriteHeader
from pdserve.kv_transfer.jobs import WriteJob
from pdserve.kv_transfer.quant import encoded_size, gather_slots, quantize
from pdserve.kv_transfer.queued import QueuedSender


class TcpSender(QueuedSender):
    backend = "tcp"

    def _setup(self, peer: dict) -> None:
        self._kv_bytes = kv_bytes_view(self.kv_cache) if self.kv_cache.device.type == "cpu" else None

    def _max_layers_per_write(self, num_tokens: int) -> int:
        per_layer = max(1, encoded_size(self.layout, num_tokens, self.encoding))
        return max(1, self.limits.max_payload_bytes // 4 // per_layer)

    def _write(self, job: WriteJob) -> None:
        payload = []
        for layer in job.layers:
            if self.encoding == "raw" and self._kv_bytes is not None:
                payload += [self._kv_bytes[layer, s : s + n].numpy().data for s, n in job.src_runs]
            elif self.encoding == "raw":
                payload.append(gather_slots(self.kv_cache, layer, job.src_runs).cpu().view(torch.uint8).numpy().data)
            else:
                payload.append(quantize(gather_slots(self.kv_cache, layer, job.src_runs), self.encoding))
        lease = job.lease
        self.link.send(WriteHeader(lease.request_id, lease.fence, job.layers.start, job.start, job.end - job.start,
                                   self.encoding, len(job.layers)), *payload)
        self.bytes_sent += sum(memoryview(p).nbytes for p in payload)
