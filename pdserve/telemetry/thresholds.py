"""The levels above which the design articles alert on the router's indicators, read by the
dashboard (a line on each panel) and by `pdserve top` (ALERT beside the value)."""

from __future__ import annotations

# indicator (a gauge the router exports) -> the share above which it needs an operator
ALERT_ABOVE = {
    "pdserve_decode_waiting_share": 0.15,  # decode pools hold requests queued or waiting for KV
    "pdserve_kv_transfer_ttft_share": 0.2,  # KV transfer not hidden behind prefill, of TTFT
}
