"""The prefill side of KV transfer over a socket: pdserve's own framed protocol.

The KV travels in the frames of the control link (control.py; the queue and its thread are
queued.py's): each WRITE carries one or more layers of a range of positions, gathered straight
from the cache's slots (or quantized, with `--kv-transfer-dtype`), received by the decode worker
straight into the leased blocks.
"""

from __future__ import annotations

from pdserve.kv_transfer.jobs import WriteJob
from pdserve.kv_transfer.queued import QueuedSender


class TcpSender(QueuedSender):
    backend = "tcp"

    def _write(self, job: WriteJob) -> None:
        self._send_payload(job)
