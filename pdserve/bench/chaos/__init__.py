"""`pdserve bench chaos`: a seeded load against a local cluster while faults are injected at seeded
times (workers killed, frozen, drained; the router killed; KV links cut), against the same run
without faults: goodput, requests lost (must be none), KV blocks left in use, and where each
recovery's time went (see run.py)."""
