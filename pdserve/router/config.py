"""The router's settings, in one place: what `pdserve router` (and `pdserve serve`) set from their
flags, and what a library user passes to `Router`."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.router.policy import DecodeWeights, DisaggregationPolicy, HotSpotRelief
from pdserve.router.rebalance import RebalancePolicy


@dataclass
class RouterConfig:
    model_name: str
    max_model_len: int
    api_key: str = ""
    worker_token: str = ""
    admin_key: str = ""  # the admin API's Bearer key; none: no admin API
    lease_s: float = 10.0
    decode_weights: DecodeWeights = field(default_factory=DecodeWeights)
    disaggregation: DisaggregationPolicy = field(default_factory=DisaggregationPolicy)
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1 << 20
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    max_body_bytes: int = 8 << 20
    keepalive_s: float = 5.0  # SSE comment after this long without a token
    max_tokens_default: int = 1024  # max_tokens of a chat request that sets none (within the context left)
    worker_silence_s: float = 60.0  # a worker stream with no line (workers send keep-alives) for this long is lost
    queue_timeout_s: float = 300.0  # a request admitted here waits at most this long for a worker with room
    client_stall_s: float = 30.0  # a client that reads nothing for this long, with output waiting, is dropped
    migrate_on_failure: bool = False  # a decode worker lost mid-stream: continue on another
    migrate_hot_spots: bool = True  # move running requests off decode workers past the hot KV use
    relief: HotSpotRelief = field(default_factory=HotSpotRelief)
    rebalance: RebalancePolicy | None = None  # the P:D controller moves workers between pools; None: off
